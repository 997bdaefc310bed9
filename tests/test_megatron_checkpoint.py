"""Megatron-core streaming: the checkpoint's sidecar and the refusals that need no GPU.

The state dirs themselves are greenroom.optim checkpoints (tested with StreamingAdam in
the optim tests); here: where a megatron checkpoint's streamed state is looked up, what
a checkpoint without it does, and how a changed parallel layout or shard list is named.
"""

import json
import os

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e .[megatron])")

from greenroom.errors import CheckpointError
from greenroom.megatron.checkpoint import SUBDIR, locate, sidecar_record, state_dir, verify_sidecar
from greenroom.megatron.layout import ShardEntry, Topology
from greenroom.rankdir import write_json_atomic

ENTRIES = [ShardEntry(name="embedding.word_embeddings.weight", group=0, index=0, shape=(1024, 256), start=0,
                      numel=262144),
           ShardEntry(name="decoder.layers.0.mlp.linear_fc1.weight", group=1, index=0, shape=(1024, 256), start=0,
                      numel=262144)]


def _write(checkpoint, topology=Topology(), entries=ENTRIES, index=0, rank=0):
    path = state_dir(checkpoint, index, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json_atomic(path + ".megatron.json", sidecar_record(topology, entries))
    return path


def test_a_checkpoint_without_streamed_state_is_refused(disk_dir):
    with pytest.raises(CheckpointError, match="no streamed optimizer state .*written before streaming was enabled"
                                              ".*no_load_optim=True"):
        locate(disk_dir, 0, 0, no_load_optim=False)


def test_no_load_optim_accepts_it_with_a_warning(disk_dir):
    with pytest.warns(UserWarning, match="starting a fresh optimizer state"):
        assert locate(disk_dir, 0, 0, no_load_optim=True) is None


def test_the_state_of_this_rank_is_found_with_its_record(disk_dir):
    path = _write(disk_dir, Topology(tp=2, tp_rank=1), rank=3)
    found, saved = locate(disk_dir, 0, 3, no_load_optim=False)
    assert found == path == os.path.join(disk_dir, SUBDIR, "opt0.rank00003")
    verify_sidecar(path, saved, Topology(tp=2, tp_rank=1), ENTRIES)


def test_a_rank_the_checkpoint_does_not_have_is_named_with_the_saved_layout(disk_dir):
    _write(disk_dir, Topology(dp=2, dp_rank=0), rank=0)
    _write(disk_dir, Topology(dp=2, dp_rank=1), rank=1)
    with pytest.raises(CheckpointError, match="no streamed state for optimizer 0 of rank 2; it was written by 2 "
                                              "optimizer shard.* with tp 1, pp 1, dp 2, ep 1, cp 1"):
        locate(disk_dir, 0, 2, no_load_optim=False)


@pytest.mark.parametrize(("saved", "named"), [
    (Topology(tp=2), "tp 2 -> 1"),
    (Topology(dp=2, dp_rank=1), "dp 2 -> 1, dp_rank 1 -> 0"),
    (Topology(ep=4), "ep 4 -> 1"),
    (Topology(pp=2), "pp 2 -> 1"),
])
def test_a_changed_parallel_layout_fails_naming_what_changed(disk_dir, saved, named):
    path = _write(disk_dir, saved)
    _, record = locate(disk_dir, 0, 0, no_load_optim=False)
    with pytest.raises(CheckpointError, match="different parallel layout") as info:
        verify_sidecar(path, record, Topology(), ENTRIES)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_a_different_shard_list_is_refused(disk_dir):
    path = _write(disk_dir)
    _, record = locate(disk_dir, 0, 0, no_load_optim=False)
    with pytest.raises(CheckpointError, match="2 streamed param shards saved, this run has 1"):
        verify_sidecar(path, record, Topology(), ENTRIES[:1])
    moved = [ENTRIES[0], ShardEntry(name=ENTRIES[1].name, group=1, index=0, shape=(1024, 256), start=128,
                                    numel=262016)]
    with pytest.raises(CheckpointError, match="layout differs at decoder.layers.0.mlp.linear_fc1.weight"):
        verify_sidecar(path, record, Topology(), moved)


def test_a_damaged_or_foreign_sidecar_is_refused(disk_dir):
    path = _write(disk_dir)
    with open(path + ".megatron.json", "w", encoding="utf-8") as f:
        f.write("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON.*damaged"):
        locate(disk_dir, 0, 0, no_load_optim=False)
    with pytest.raises(CheckpointError, match="format 'other' version 7"):
        verify_sidecar(path, {"format": "other", "version": 7}, Topology(), ENTRIES)


def test_the_sidecar_is_plain_json(disk_dir):
    path = _write(disk_dir, Topology(tp=2))
    with open(path + ".megatron.json", encoding="utf-8") as f:
        record = json.load(f)
    assert record["topology"]["tp"] == 2
    assert [s["name"] for s in record["shards"]] == [e.name for e in ENTRIES]
