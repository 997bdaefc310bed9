"""The streamed optimizer state in megatron-core's ``dp_reshardable`` format, on CPU gloo ranks.

What runs for real: megatron-core 0.16.1's GPTModel, its parallel state, its range math
(``_build_gbuf_range_map``), stock's own ``DistributedOptimizer.sharded_state_dict`` for
``dp_reshardable`` (with its ``state_dict``, ``get_parameter_state_dp_reshardable`` and
``sharded_param_state_dp_reshardable``) and its own load walk
``load_parameter_state_from_dp_reshardable``, ``dist_checkpointing.save``/``load``
(torch_dist), greenroom's BucketStore on real files behind a real
StreamingDistributedOptimizer's ``sharded_state_dict``/``load_state_dict``.

What stands in, and why: the DistributedOptimizer cannot be built without CUDA
(``mcore_support``), so stock's methods run unbound on a namespace carrying what they
read: the same stand-in DDP buffer as the streaming member (several buckets, DDP's
intra-param padding, so that padding pieces occur), ``gbuf_ranges``, the bucket sizes,
and each owned param's fp32 main and moments as the tensors
``_get_main_param_and_optimizer_states`` returns (stock reads them from its inner Adam).
"""

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e .[megatron])")

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.mapping import (  # noqa: E402
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
)
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: E402

from greenroom.errors import CheckpointError  # noqa: E402
from greenroom.megatron import dp_format, mcore_format  # noqa: E402
from tests.megatron.mcore_support import STATES, assert_loaded, by_param_of, gpt, member, saved_value, spawn  # noqa: E402

DP = {"distrib_optim_sharding_type": "dp_reshardable"}
SAVED_STEP, SAVED_LR = 7, 5e-4
BUCKET_NUMEL, ALIGN = 1500, 32  # several buckets; 16-element params leave 16-element gaps


@pytest.fixture
def cpu_save():
    """Whether the ranks stub the two CUDA-only calls of megatron-core 0.16.1's torch_dist save."""
    return not torch.cuda.is_available()


def _streaming(rank, work, moment_dtype, bucket_numel=BUCKET_NUMEL, tp=1):
    model = gpt(tp, 1)
    msd = model.sharded_state_dict()
    opt, streamed, resident = member(
        os.path.join(work, f"r{rank}"), msd, model, moment_dtype, bucket_numel=bucket_numel, align=ALIGN
    )
    return model, msd, opt, streamed, resident


def _fill(opt, streamed, resident, by_param):
    """The member's state: every element its analytic value, step SAVED_STEP, lr SAVED_LR."""

    def fill(state):
        for k, m, e, s in zip(
            state.bucket.entries, state.views(state.master), state.views(state.exp_avg), state.views(state.exp_avg_sq)
        ):
            p, a, b = streamed[k]
            for name, view in (("param", m), ("exp_avg", e), ("exp_avg_sq", s)):
                view.copy_(saved_value(by_param, p, a, b, name))  # the store encodes the moments

    opt.store.overwrite(fill)
    for shard, (p, a, b) in zip(opt.shard_fp32_groups[0], resident):
        shard.copy_(saved_value(by_param, p, a, b, "param"))
        opt.resident_optimizer.state[shard] = {
            "step": torch.tensor(float(SAVED_STEP)),
            "exp_avg": saved_value(by_param, p, a, b, "exp_avg"),
            "exp_avg_sq": saved_value(by_param, p, a, b, "exp_avg_sq"),
        }
    opt.streamed_steps = SAVED_STEP
    opt.optimizer.param_groups[0]["lr"] = SAVED_LR


def _stock(opt, by_param, *, empty=False):
    """Stock's DistributedOptimizer methods bound to a namespace over ``opt``'s stand-in
    buffers: its inner Adam's state per owned param is the analytic values (zeros if
    ``empty``), at step SAVED_STEP, its param groups an AdamW's with lr SAVED_LR. Returns
    it and the list its load walk appends ``(model param, tensors)`` to."""
    owned = {}
    for ranges in opt.gbuf_ranges:
        for per_bucket in ranges.values():
            for bucket in per_bucket:
                for p, r in bucket["param_map"].items():
                    a, b = r["param"].start, r["param"].end
                    owned[p] = {"param": torch.zeros(b - a) if empty else saved_value(by_param, p, a, b, "param")}
                    owned[p]["step"] = torch.tensor(float(SAVED_STEP))
                    for s in ("exp_avg", "exp_avg_sq"):
                        owned[p][s] = torch.zeros(b - a) if empty else saved_value(by_param, p, a, b, s)
    inner = torch.optim.AdamW([torch.zeros(1)], lr=SAVED_LR)
    inner.state[inner.param_groups[0]["params"][0]] = {"step": torch.tensor(float(SAVED_STEP))}
    loaded = []
    stub = SimpleNamespace(
        ddp_config=SimpleNamespace(use_megatron_fsdp=False),
        optimizer=inner,
        grad_scaler=None,
        buffers=opt.buffers,
        gbuf_ranges=opt.gbuf_ranges,
        per_bucket_numel=opt.per_bucket_numel,
        per_bucket_numel_unpadded=opt.per_bucket_numel_unpadded,
        data_parallel_group=opt.data_parallel_group,
        data_parallel_group_idx=opt.data_parallel_group_idx,
        distributed_optimizer_instance_id=opt.distributed_optimizer_instance_id,
        checkpoint_fully_reshardable_formats=DistributedOptimizer.checkpoint_fully_reshardable_formats,
        _get_main_param_and_optimizer_states=lambda p: dict(owned[p]),
        _set_main_param_and_optimizer_states=lambda p, tensors: loaded.append((p, tensors)),
        load_state_dict=lambda state_dict: None,  # stock allocates its inner state here; the stub's exists
    )
    for name in ("state_dict", "get_parameter_state_dp_reshardable", "sharded_param_state_dp_reshardable"):
        setattr(stub, name, getattr(DistributedOptimizer, name).__get__(stub))
    return stub, loaded


def _stock_sharded(stub, msd, is_loading=False):
    return DistributedOptimizer.sharded_state_dict(stub, msd, is_loading, metadata=dict(DP))


# -- (i) the keys, offsets, replica ids and values stock emits ---------------------------
def _assert_like_stock(ours, stock, path="", padding=False):
    """``ours`` has stock's structure, metadata and (outside padding) data; plus, at the
    top, the greenroom record."""
    where = path or "/"
    if isinstance(stock, dict):
        assert isinstance(ours, dict), where
        extra = {"greenroom"} if path == "" else set()
        assert set(ours) == set(stock) | extra, (where, set(ours) ^ set(stock))
        pad = padding or (isinstance(stock.get("padding"), LocalNonpersistentObject) and stock["padding"].obj)
        for k in stock:
            _assert_like_stock(ours[k], stock[k], f"{path}/{k}", pad)
    elif isinstance(stock, list):
        assert isinstance(ours, list) and len(ours) == len(stock), (where, len(ours), len(stock))
        for k, (a, b) in enumerate(zip(ours, stock)):
            _assert_like_stock(a, b, f"{path}/{k}", padding)
    elif isinstance(stock, ShardedTensor):
        assert isinstance(ours, ShardedTensor), where
        for field in (
            "key",
            "dtype",
            "local_shape",
            "global_shape",
            "global_offset",
            "axis_fragmentations",
            "replica_id",
            "prepend_axis_num",
            "allow_shape_mismatch",
            "flattened_range",
        ):
            assert getattr(ours, field) == getattr(stock, field), (where, field, getattr(ours, field))
        if not padding:  # stock's padding is torch.empty
            assert torch.equal(ours.data, stock.data), where
    elif isinstance(stock, ShardedObject):
        assert isinstance(ours, ShardedObject), where
        for field in ("key", "global_shape", "global_offset", "replica_id"):
            assert getattr(ours, field) == getattr(stock, field), (where, field)
        assert ours.data == stock.data, where
    elif isinstance(stock, LocalNonpersistentObject):
        assert isinstance(ours, LocalNonpersistentObject), where
        if path.endswith("/padding"):
            assert ours.obj == stock.obj, where
        elif not padding:  # the step
            assert torch.equal(ours.obj, stock.obj), where
    else:
        assert ours == stock, where


def _mapped_file(address: int) -> str | None:
    """The file this process maps at ``address`` (/proc/self/maps), if any."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) == 6 else None
    return None


def _parity(rank, world, tp, work):
    _, msd, opt, streamed, resident = _streaming(rank, work, "fp32", tp=tp)
    by_param = by_param_of(msd)
    _fill(opt, streamed, resident, by_param)
    stock = _stock_sharded(_stock(opt, by_param)[0], msd)
    ours = opt.sharded_state_dict(msd, metadata=dict(DP))
    assert ours["param_state_sharding_type"] == "dp_reshardable"
    pads = [t for by_dtype in stock["param_state"][0].values() for bucket in by_dtype for t in bucket]
    gaps = torch.tensor([sum(t["padding"].obj for t in pads)])
    torch.distributed.all_reduce(gaps)
    assert int(gaps) > 0  # the layout has gaps to cover, on some rank
    assert len(opt.buffers[0].buckets) >= 3
    _assert_like_stock(ours, stock)
    # the streamed slices' data are maps of the frozen bucket files, not copies, each
    # storage exactly its bytes (staging Note [a save's own maps])
    frozen = set(opt._mcore_save.paths.values())
    first = next(iter(opt.buffers[0].param_index_map))  # the resident one
    group = opt.data_parallel_group
    ((dtype, buckets),) = dp_format.layout(opt.gbuf_ranges, opt.buffers, group.rank(), group.size())[0].items()
    for pieces, saved in zip(buckets, ours["param_state"][0][dtype]):
        for piece, tensors in zip(pieces, saved):
            if not piece.padding and piece.param is not first:
                for name in STATES:
                    data = tensors[name].data
                    assert _mapped_file(data.data_ptr()) in frozen, (piece, name)
                    assert data.untyped_storage().nbytes() == data.nbytes, (piece, name)
    opt.close()


@pytest.mark.parametrize("world,tp", [(1, 1), (2, 1), (3, 1), (2, 2)])
def test_the_sharded_state_dict_is_stocks_dp_reshardable_one(disk_dir, world, tp):
    spawn(_parity, world, tp, os.path.join(disk_dir, "work"))


# -- (ii) checkpoints across DP, between stock and streaming ----------------------------
def _save_streamed(rank, world, ckpt, work, moment_dtype, decode_in_save=False):
    from greenroom.megatron import DECODE_IN_SAVE, StreamedSaveStrategy

    _, msd, opt, streamed, resident = _streaming(rank, work, moment_dtype)
    _fill(opt, streamed, resident, by_param_of(msd))
    state = opt.sharded_state_dict(msd, metadata={**DP, DECODE_IN_SAVE: decode_in_save})
    strategy = StreamedSaveStrategy() if decode_in_save else None
    dist_checkpointing.save({"optimizer": state}, ckpt, sharded_strategy=strategy)
    opt.close()


def _save_stock(rank, world, ckpt, work):
    _, msd, opt, _, _ = _streaming(rank, work, "fp32")
    dist_checkpointing.save({"optimizer": _stock_sharded(_stock(opt, by_param_of(msd))[0], msd)}, ckpt)
    opt.close()


def _load_stock(rank, world, ckpt, work, moment_dtype):
    """Stock's own template and load walk read the checkpoint."""
    _, msd, opt, _, _ = _streaming(rank, work, "fp32")
    by_param = by_param_of(msd)
    stub, loaded = _stock(opt, by_param, empty=True)
    state = dist_checkpointing.load({"optimizer": _stock_sharded(stub, msd, is_loading=True)}, ckpt)["optimizer"]
    assert state["param_state_sharding_type"] == "dp_reshardable"
    assert state["optimizer"]["param_groups"][0]["step"] == SAVED_STEP
    assert state["optimizer"]["param_groups"][0]["lr"] == SAVED_LR
    DistributedOptimizer.load_parameter_state_from_dp_reshardable(stub, state["param_state"])
    ranges = {p: r for rs in opt.gbuf_ranges for pb in rs.values() for b in pb for p, r in b["param_map"].items()}
    assert [p for p, _ in loaded] == list(ranges)
    first = next(iter(opt.buffers[0].param_index_map))  # the resident one: saved from its fp32 Adam
    for p, tensors in loaded:
        a, b = ranges[p]["param"].start, ranges[p]["param"].end
        for name in STATES:
            want = saved_value(by_param, p, a, b, name, "fp32" if p is first else moment_dtype)
            assert torch.equal(tensors[name], want), (p.shape, name)
    opt.close()


def _load_streamed(rank, world, ckpt, work, moment_dtype, saved_dtype):
    _, msd, opt, streamed, resident = _streaming(rank, work, moment_dtype)
    by_param = by_param_of(msd)
    opt.store.initialize(lambda i: torch.zeros(opt.shard_entries[i].numel))
    opt._failed = "an earlier step() failed"  # a whole load cures the poison
    template = {"optimizer": opt.sharded_state_dict(msd, is_loading=True, metadata=dict(DP))}
    mcore_format.check_saved(
        template,
        dist_checkpointing.load_tensors_metadata(ckpt),
        dist_checkpointing.load_common_state_dict(ckpt).get("optimizer"),
        ckpt,
    )
    loaded = dist_checkpointing.load(template, ckpt)["optimizer"]
    staging = os.path.join(opt._state_dir.path, "mcore-load")
    if saved_dtype != "fp32" and moment_dtype != saved_dtype:
        with pytest.raises(CheckpointError) as e:
            opt.load_state_dict(loaded)
        assert "\n" not in str(e.value) and str(e.value).endswith(f"moment-dtype {saved_dtype}"), e.value
        assert os.listdir(staging) == [] and opt.streamed_steps == 0 and opt._failed is not None
        opt.close()
        return
    opt.load_state_dict(loaded)
    assert os.listdir(staging) == []
    assert_loaded(opt, streamed, resident, by_param, moment_dtype, SAVED_STEP, SAVED_LR)
    opt.close()


def test_a_streamed_checkpoint_at_dp2_resumes_under_stock_and_streaming_at_dp1_and_dp2(disk_dir, cpu_save):
    ckpt, work = os.path.join(disk_dir, "ckpt"), os.path.join(disk_dir, "work")
    os.makedirs(ckpt)
    spawn(_save_streamed, 2, ckpt, os.path.join(work, "save"), "fp32", cpu_save=cpu_save)
    assert dist_checkpointing.load_common_state_dict(ckpt)["optimizer"]["greenroom"]["moment_dtype"] == "fp32"
    for world in (1, 2):
        spawn(_load_stock, world, ckpt, os.path.join(work, f"stock{world}"), "fp32", cpu_save=cpu_save)
    spawn(_load_streamed, 1, ckpt, os.path.join(work, "streamed1"), "fp32", "fp32", cpu_save=cpu_save)


def test_a_stock_checkpoint_at_dp1_resumes_under_streaming_at_dp2_and_dp1(disk_dir, cpu_save):
    ckpt, work = os.path.join(disk_dir, "ckpt"), os.path.join(disk_dir, "work")
    os.makedirs(ckpt)
    spawn(_save_stock, 1, ckpt, os.path.join(work, "save"), cpu_save=cpu_save)
    for world, run_dtype in ((2, "fp32"), (1, "bf16")):
        spawn(_load_streamed, world, ckpt, os.path.join(work, f"l{world}"), run_dtype, "fp32", cpu_save=cpu_save)


@pytest.mark.parametrize("decode_in_save", [False, True])
def test_moments_streamed_as_bf16_load_into_stock_as_their_values_and_only_into_a_bf16_run(
    disk_dir, cpu_save, decode_in_save
):
    """bf16 moments, decoded into fp32 files for megatron's writer or, through
    StreamedSaveStrategy, by the save itself (``decode_in_save``): stock reads the same
    values (the refusal and the resume under streaming do not depend on the save's way)."""
    ckpt, work = os.path.join(disk_dir, "ckpt"), os.path.join(disk_dir, "work")
    os.makedirs(ckpt)
    spawn(_save_streamed, 1, ckpt, os.path.join(work, "save"), "bf16", decode_in_save, cpu_save=cpu_save)
    spawn(_load_stock, 2, ckpt, os.path.join(work, "stock"), "bf16", cpu_save=cpu_save)
    for run in ("fp32", "bf16") if not decode_in_save else ():
        spawn(_load_streamed, 1, ckpt, os.path.join(work, run), run, "bf16", cpu_save=cpu_save)


# -- (iii) the DDP buckets must match ---------------------------------------------------
def _other_buckets(rank, world, ckpt, work):
    _, msd, opt, _, _ = _streaming(rank, work, "fp32", bucket_numel=2 * BUCKET_NUMEL)
    template = {"optimizer": opt.sharded_state_dict(msd, is_loading=True, metadata=dict(DP))}
    with pytest.raises(CheckpointError) as e:
        mcore_format.check_saved(template, dist_checkpointing.load_tensors_metadata(ckpt), None, ckpt)
    msg = str(e.value)
    assert "\n" not in msg and "'dp_reshardable' optimizer checkpoint resumes only across DP" in msg, msg
    assert msg.endswith("(Megatron-LM: --dist-ckpt-optim-fully-reshardable), which reshards across TP/PP/DP")
    opt.close()


def _altered_buckets(rank, world, ckpt, work):
    """Bucket tensors of the same lengths but another bucket record (a checkpoint with
    more buckets than this run has would load its first ones without complaint):
    ``load_state_dict`` refuses it before writing a byte, and so does stock's load."""
    _, msd, opt, _, _ = _streaming(rank, work, "fp32")
    opt.store.initialize(lambda i: torch.zeros(opt.shard_entries[i].numel))
    loaded = dist_checkpointing.load(
        {"optimizer": opt.sharded_state_dict(msd, is_loading=True, metadata=dict(DP))}, ckpt
    )["optimizer"]
    record = loaded["param_state"]["per_bucket_numel_unpadded"]
    ((dtype, sizes),) = record[0].items()
    loaded["param_state"]["per_bucket_numel_unpadded"] = [{dtype: [*sizes, 64]}]
    with pytest.raises(CheckpointError) as e:
        opt.load_state_dict(loaded)
    msg = str(e.value)
    assert "\n" not in msg and f"per_bucket_numel_unpadded [{{{dtype}: {[*sizes, 64]}}}] in the checkpoint" in msg
    assert "'dp_reshardable'" in msg and "'fully_reshardable'" in msg
    assert os.listdir(os.path.join(opt._state_dir.path, "mcore-load")) == [] and opt.streamed_steps == 0
    for state in opt.store.stream():  # the live state is as it was
        assert not state.master.any() and not state.exp_avg.any()
    stub, _ = _stock(opt, by_param_of(msd), empty=True)
    with pytest.raises(AssertionError, match="Number of unpadded elements in each bucket"):
        DistributedOptimizer.load_parameter_state_from_dp_reshardable(stub, loaded["param_state"])
    opt.close()


def test_a_checkpoint_of_other_ddp_buckets_is_refused_in_one_line_naming_fully_reshardable(disk_dir, cpu_save):
    ckpt, work = os.path.join(disk_dir, "ckpt"), os.path.join(disk_dir, "work")
    os.makedirs(ckpt)
    spawn(_save_streamed, 1, ckpt, os.path.join(work, "save"), "fp32", cpu_save=cpu_save)
    spawn(_other_buckets, 1, ckpt, os.path.join(work, "other"), cpu_save=cpu_save)
    spawn(_altered_buckets, 1, ckpt, os.path.join(work, "altered"), cpu_save=cpu_save)
