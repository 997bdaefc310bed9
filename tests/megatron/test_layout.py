"""Megatron-core streaming: the DP-shard topology a streamed checkpoint belongs to."""

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e .[megatron])")

from greenroom.megatron.layout import ShardEntry, Topology, current_topology


def test_same_topology_has_no_mismatch():
    topo = Topology(tp=2, pp=2, dp=4, ep=1, tp_rank=1, pp_rank=0, dp_rank=3)
    assert topo.mismatch(Topology.from_record(topo.record())) is None


@pytest.mark.parametrize(
    ("saved", "named"),
    [
        (dict(tp=2), "tp 2 -> 1"),
        (dict(pp=4, pp_rank=3), "pp 4 -> 1, pp_rank 3 -> 0"),
        (dict(dp=8), "dp 8 -> 1"),
        (dict(ep=2), "ep 2 -> 1"),
        (dict(cp=2), "cp 2 -> 1"),
        (dict(dp_rank=1, dp=2), "dp 2 -> 1, dp_rank 1 -> 0"),
    ],
)
def test_a_changed_topology_names_what_changed(saved, named):
    message = Topology().mismatch(Topology(**saved))
    assert named in message
    assert "same TP/PP/DP/EP/CP" in message and "no_load_optim" in message
    assert "\n" not in message


def test_a_record_with_unknown_keys_still_loads():
    assert Topology.from_record({"tp": 2, "future_axis": 3}) == Topology(tp=2)


def test_without_model_parallel_state_the_topology_is_all_ones():
    assert current_topology() == Topology()


def test_shard_entry_record_is_json_ready():
    entry = ShardEntry(name="decoder.layers.0.mlp.linear_fc1.weight", group=1, index=2, shape=(8, 4), start=4, numel=20)
    assert entry.record() == {
        "name": "decoder.layers.0.mlp.linear_fc1.weight",
        "group": 1,
        "index": 2,
        "shape": [8, 4],
        "start": 4,
        "numel": 20,
    }
