"""Megatron-core streaming: the checkpoint's sidecar and the refusals that need no GPU.

The state dirs themselves are greenroom.optim checkpoints (tested with StreamingAdam in
the optim tests); here: where a megatron checkpoint's streamed state is looked up, what
a checkpoint without it does, how a changed parallel layout or shard list is named, and
that greenroom.optim's checkpoint reads and restores the streaming DistributedOptimizer's
state through the optimizer's own methods (the real class on real files; see _optimizer).
"""

import json
import logging
import os

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e .[megatron])")

from greenroom.dirs.tree import write_json_atomic
from greenroom.errors import CheckpointError
from greenroom.megatron import load_checkpoint, save_checkpoint
from greenroom.megatron.checkpoint import SUBDIR, locate, sidecar_record, state_dir, verify_sidecar
from greenroom.megatron.inner_optimizer import resident_adam
from greenroom.megatron.layout import ShardEntry, Topology
from greenroom.megatron.optimizer import StreamingDistributedOptimizer
from greenroom.optim.store.bucket_store import BucketStore, Entry

ENTRIES = [
    ShardEntry(name="embedding.word_embeddings.weight", group=0, index=0, shape=(1024, 256), start=0, numel=262144),
    ShardEntry(
        name="decoder.layers.0.mlp.linear_fc1.weight", group=1, index=0, shape=(1024, 256), start=0, numel=262144
    ),
]


def _write(checkpoint, topology=Topology(), entries=ENTRIES, index=0, rank=0):
    path = state_dir(checkpoint, index, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_json_atomic(path + ".megatron.json", sidecar_record(topology, entries))
    return path


def test_a_checkpoint_without_streamed_state_is_refused(disk_dir):
    with pytest.raises(
        CheckpointError, match="no streamed optimizer state .*written before streaming was enabled.*no_load_optim=True"
    ):
        locate(disk_dir, 0, 0, no_load_optim=False)


def test_no_load_optim_accepts_it_with_a_warning(disk_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="greenroom"):
        assert locate(disk_dir, 0, 0, no_load_optim=True) is None
    assert [r.levelname for r in caplog.records if "starting a fresh optimizer state" in r.getMessage()] == ["WARNING"]


def test_the_state_of_this_rank_is_found_with_its_record(disk_dir):
    path = _write(disk_dir, Topology(tp=2, tp_rank=1), rank=3)
    found, saved = locate(disk_dir, 0, 3, no_load_optim=False)
    assert found == path == os.path.join(disk_dir, SUBDIR, "opt0.rank00003")
    verify_sidecar(path, saved, Topology(tp=2, tp_rank=1), ENTRIES)


def test_a_rank_the_checkpoint_does_not_have_is_named_with_the_saved_layout(disk_dir):
    _write(disk_dir, Topology(dp=2, dp_rank=0), rank=0)
    _write(disk_dir, Topology(dp=2, dp_rank=1), rank=1)
    with pytest.raises(
        CheckpointError,
        match="no streamed state for optimizer 0 of rank 2; it was written by 2 "
        "optimizer shard.* with tp 1, pp 1, dp 2, ep 1, cp 1",
    ):
        locate(disk_dir, 0, 2, no_load_optim=False)


@pytest.mark.parametrize(
    ("saved", "named"),
    [
        (Topology(tp=2), "tp 2 -> 1"),
        (Topology(dp=2, dp_rank=1), "dp 2 -> 1, dp_rank 1 -> 0"),
        (Topology(ep=4), "ep 4 -> 1"),
        (Topology(pp=2), "pp 2 -> 1"),
    ],
)
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
    moved = [ENTRIES[0], ShardEntry(name=ENTRIES[1].name, group=1, index=0, shape=(1024, 256), start=128, numel=262016)]
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


def _optimizer(directory, entries, *, lr, moment_dtype="fp32"):
    """A real StreamingDistributedOptimizer for its checkpoint methods. Its constructor
    needs CUDA and megatron's DDP, so the instance gets what the constructor leaves: a
    real BucketStore on real files, the main shards with their storage freed, an inner
    torch AdamW over [fp32 shards, mains] per group whose groups carry an object JSON
    cannot hold (megatron's do), and the resident Adam built as the constructor builds it."""
    os.makedirs(directory, exist_ok=True)
    opt = object.__new__(StreamingDistributedOptimizer)
    opt.shard_entries = entries
    opt._store = BucketStore(
        [Entry(name=e.name, shape=(e.numel,), group=e.group) for e in entries],
        directory,
        bucket_numel=300_000,
        moment_dtype=moment_dtype,
        chunk_bytes=1 << 20,
    )
    opt.shard_fp32_from_float16_groups = [[], []]
    for e in entries:
        main = torch.zeros(e.numel)
        main.untyped_storage().resize_(0)  # as the real one leaves its main shards
        opt.shard_fp32_from_float16_groups[e.group].append(main)
    opt.shard_fp32_groups = [[torch.zeros(40)], []]
    opt.optimizer = torch.optim.AdamW(
        [{"params": [*fp32, *mains]} for fp32, mains in zip(opt.shard_fp32_groups, opt.shard_fp32_from_float16_groups)],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    opt.optimizer.param_groups[0].update(weight_decay=0.01, default_config=object())
    opt.optimizer.param_groups[1].update(weight_decay=0.0)
    opt.resident_optimizer = resident_adam(opt.optimizer, opt.shard_fp32_groups)
    opt.streamed_steps = 0
    opt.topology = Topology()
    return opt


def test_streamed_state_round_trips_through_greenroom_optims_checkpoint(disk_dir):
    saved = _optimizer(os.path.join(disk_dir, "a"), ENTRIES, lr=1e-3)
    saved.store.initialize(lambda i: torch.full((ENTRIES[i].numel,), float(i + 1)))
    for state in saved.store.stream():
        state.exp_avg.uniform_()
        state.exp_avg_sq.uniform_()
    saved.shard_fp32_groups[0][0].grad = torch.ones(40)
    saved.resident_optimizer.step()
    saved.streamed_steps = 3
    saved.optimizer.param_groups[1]["lr"] = 5e-4  # a scheduler moved it
    save_checkpoint(saved, os.path.join(disk_dir, "ckpt"))

    loaded = _optimizer(os.path.join(disk_dir, "b"), ENTRIES, lr=1e-3)
    loaded.store.initialize(lambda i: torch.zeros(ENTRIES[i].numel))
    load_checkpoint(loaded, os.path.join(disk_dir, "ckpt"))

    assert loaded.streamed_steps == 3
    assert loaded.optimizer.param_groups[1]["lr"] == 5e-4
    assert loaded.optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    ref, ours = (
        saved.resident_optimizer.state[saved.shard_fp32_groups[0][0]],
        loaded.resident_optimizer.state[loaded.shard_fp32_groups[0][0]],
    )
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert torch.equal(ref[key], ours[key])
    for a, b in zip(saved.store.stream(), loaded.store.stream()):
        for x, y in ((a.master, b.master), (a.exp_avg, b.exp_avg), (a.exp_avg_sq, b.exp_avg_sq)):
            assert torch.equal(x, y)
    saved.close()
    loaded.close()


def test_moments_saved_as_bf16_are_not_read_as_fp32(disk_dir):
    saved = _optimizer(os.path.join(disk_dir, "a"), ENTRIES, lr=1e-3, moment_dtype="bf16")
    saved.store.initialize(lambda i: torch.ones(ENTRIES[i].numel))
    save_checkpoint(saved, os.path.join(disk_dir, "ckpt"))
    loaded = _optimizer(os.path.join(disk_dir, "b"), ENTRIES, lr=1e-3)
    with pytest.raises(CheckpointError, match="moment dtype bf16, this run uses fp32"):
        load_checkpoint(loaded, os.path.join(disk_dir, "ckpt"))
    saved.close()
    loaded.close()


def test_after_a_failed_step_the_streaming_distributed_optimizer_refuses_until_loaded(disk_dir, fail_a_write_of):
    """optim.poison Note [a failed step poisons], as StreamingAdam's: bucket 1's
    write-back fails in a step (EIO at the engine's syscall wrapper, once), after bucket
    0 was stepped; the next step, ``state_dict()`` and ``save_checkpoint`` each refuse in
    one line naming the failure, and ``load_checkpoint`` brings back the saved state
    (``torch.equal``) and lifts the refusal. The step runs the real ``_stream_step``;
    only the 16-bit param buffer it casts the mains into is a plain tensor per shard
    (megatron's DDP buffers need CUDA), and megatron's own part after the stream (the
    all-gather) is never reached here."""
    from greenroom.errors import GreenroomError, StorageError

    opt = _optimizer(os.path.join(disk_dir, "a"), ENTRIES, lr=1e-3)
    opt.store.initialize(lambda i: torch.full((ENTRIES[i].numel,), float(i + 1)))
    opt.is_stub_optimizer, opt.grad_scaler = False, None  # what the constructor sets (bf16: no scaler)
    buffers = {(e.group, e.index): torch.empty(e.numel) for e in ENTRIES}
    opt._model_shard_for = lambda group, index: buffers[(group, index)]
    for e in ENTRIES:
        opt.main_shard(ENTRIES.index(e)).grad = torch.ones(e.numel)
    ckpt = os.path.join(disk_dir, "ckpt")
    save_checkpoint(opt, ckpt)
    saved = [[t.clone() for t in (s.master, s.exp_avg, s.exp_avg_sq)] for s in opt.store.stream()]

    fail_a_write_of(opt.store.path(1) + (".new" if opt.store.shared(1) else ""))  # linked by the save: a new inode
    with pytest.raises(StorageError, match=r"bucket-00001\.bin(\.new)?: write of .* Input/output error"):
        opt.step_with_ready_grads()
    # Half stepped: bucket 0 (entry 0) took the update, bucket 1 did not.
    assert [torch.equal(opt.streamed_state(i)[0], saved[i][0]) for i in range(2)] == [False, True]
    for what, call in (
        ("step()", opt.step_with_ready_grads),
        ("state_dict()", opt.state_dict),
        ("save_checkpoint()", lambda: save_checkpoint(opt, ckpt)),
    ):
        with pytest.raises(GreenroomError) as err:
            call()
        assert "\n" not in str(err.value)
        assert str(err.value).startswith(
            f"StreamingDistributedOptimizer: {what} refused: an earlier step() failed (StorageError: "
        )
        assert (
            "load a checkpoint (greenroom.megatron.load_checkpoint, "
            "or a fully_reshardable or dp_reshardable load_state_dict)" in str(err.value)
        )

    load_checkpoint(opt, ckpt)
    for state, expected in zip(opt.store.stream(), saved):
        assert all(torch.equal(t, e) for t, e in zip((state.master, state.exp_avg, state.exp_avg_sq), expected))
    assert opt.state_dict()["greenroom"]["steps"] == 0
    save_checkpoint(opt, ckpt)
    opt.close()


def test_a_live_bucket_file_deleted_before_the_save_is_one_checkpoint_error_naming_it(disk_dir):
    opt = _optimizer(os.path.join(disk_dir, "a"), ENTRIES, lr=1e-3)
    opt.store.initialize(lambda i: torch.ones(ENTRIES[i].numel))
    live = opt.store.path(0)
    os.unlink(live)
    with pytest.raises(
        CheckpointError,
        match=rf"^{live}: cannot save this live bucket file \(No such file or "
        r"directory\): it was deleted or made unreadable",
    ):
        save_checkpoint(opt, os.path.join(disk_dir, "ckpt"))
    opt.close()


def test_verify_reads_the_linked_files_back_before_the_save_returns(disk_dir):
    opt = _optimizer(os.path.join(disk_dir, "a"), ENTRIES, lr=1e-3)
    opt.store.initialize(lambda i: torch.ones(ENTRIES[i].numel))
    with open(opt.store.path(0), "r+b") as f:
        f.seek(4097)
        byte = f.read(1)
        f.seek(4097)
        f.write(bytes([byte[0] ^ 0x20]))
    with pytest.raises(CheckpointError, match=r"bucket-00000\.bin: checksum mismatch in extent 0"):
        save_checkpoint(opt, os.path.join(disk_dir, "ckpt"), verify=True)
    opt.close()
