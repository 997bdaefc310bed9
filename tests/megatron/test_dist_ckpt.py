"""The streaming DistributedOptimizer's checkpoint wiring (``greenroom.megatron.dist_ckpt``), on CPU.

What runs for real: megatron-core 0.16.1's own range math
(``DistributedOptimizer._build_model_gbuf_range``) and its own fully_reshardable load
walk (``load_parameter_state_from_fully_reshardable``). What stands in, and why: the
DistributedOptimizer cannot be built without CUDA (its DDP buffers and inner optimizer
allocate on ``torch.cuda.current_device()``; see ``mcore_support``), so its DDP buffers
are namespaces carrying only what those two functions read (``param_index_map``, the
buckets' sizes and offsets, the DP group's rank and size), and the optimizer, where a
refusal needs one, carries only the attribute the refusal reads. The wired save and
load themselves run in ``test_gpu_dist_ckpt.py`` on the GPU machine.
"""

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e .[megatron])")

from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer  # noqa: E402

from greenroom.errors import CheckpointError  # noqa: E402
from greenroom.megatron import dist_ckpt  # noqa: E402
from tests.megatron.mcore_support import assert_loaded, by_param_of, saved_value  # noqa: E402

PAD = 8  # each stand-in bucket is padded to a multiple of this times the DP size


def _buffer(shapes, bucket_numel, dp, dp_rank, dtype):
    """A stand-in DDP buffer of params of ``shapes``, filled in reverse order as DDP fills
    it, cut into buckets of at least ``bucket_numel`` elements at param boundaries."""
    params = [torch.zeros(s, dtype=dtype) for s in shapes]
    index_map, buckets, cursor, bucket_start = {}, [], 0, 0
    for p in reversed(params):
        index_map[p] = (cursor, cursor + p.numel(), len(buckets))
        cursor += p.numel()
        if cursor - bucket_start >= bucket_numel or p is params[0]:
            size = -(-(cursor - bucket_start) // (PAD * dp)) * PAD * dp
            buckets.append(SimpleNamespace(grad_data=torch.empty(size), offset=bucket_start))
            cursor = bucket_start = bucket_start + size
    group = SimpleNamespace(rank=lambda: dp_rank, size=lambda: dp)
    return SimpleNamespace(param_index_map=index_map, buckets=buckets, data_parallel_group=group)


def _stand_in(dp, dp_rank):
    """Two DDP buffers (a bf16 one of several buckets and an fp32 one) and megatron's own
    ``gbuf_ranges`` over them for DP rank ``dp_rank``."""
    bf16 = _buffer([(12, 5), (7,), (3, 4, 5), (33,), (9, 2)], 40, dp, dp_rank, torch.bfloat16)
    fp32 = _buffer([(6,), (4, 3)], 1000, dp, dp_rank, torch.float32)
    buffers = [bf16, fp32]
    gbuf_ranges = [
        {(dtype, torch.float32): [DistributedOptimizer._build_model_gbuf_range(b, k) for k in range(len(b.buckets))]}
        for b, dtype in zip(buffers, (torch.bfloat16, torch.float32))
    ]
    return buffers, gbuf_ranges


def _stock_walk(buffers, gbuf_ranges):
    """``(param, start, stop)`` of each owned param, as stock's fully_reshardable load
    slices it (each param's state is its flat index, so a slice names its own range)."""
    got = []
    params = [p for buffer in buffers for p in buffer.param_index_map]
    full = {i: {"param": torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape)} for i, p in enumerate(params)}

    def record(model_param, tensors):
        flat = tensors["param"]
        got.append((model_param, int(flat[0]), int(flat[-1]) + 1))

    stub = SimpleNamespace(
        gbuf_ranges=gbuf_ranges, buffers=buffers, optimizer=object(), _set_main_param_and_optimizer_states=record
    )
    DistributedOptimizer.load_parameter_state_from_fully_reshardable(stub, full)
    return got


@pytest.mark.parametrize("dp", [1, 2, 3])
def test_the_range_walk_matches_stock_fully_reshardable_order_and_slices(dp):
    covered: dict[int, list] = {}
    for dp_rank in range(dp):
        buffers, gbuf_ranges = _stand_in(dp, dp_rank)
        assert len(buffers[0].buckets) >= 3  # params straddle buckets and DP ranks
        ours = dist_ckpt.param_ranges(gbuf_ranges, buffers)
        # stock numbers every param of every buffer in param_index_map order
        order = [p for b in buffers for p in b.param_index_map]
        assert [p for p, _, _ in ours] == order
        # and slices exactly the owned ones, as its own load does
        stock = _stock_walk(buffers, gbuf_ranges)
        assert [(p, a, b) for p, a, b in ours if b > a] == stock
        for index, (_, a, b) in enumerate(ours):
            covered.setdefault(index, []).append((a, b))
    # across the DP ranks each param is cut into disjoint slices covering it once
    for index, p in enumerate(p for b in buffers for p in b.param_index_map):
        pieces = sorted(r for r in covered[index] if r[1] > r[0])
        assert pieces[0][0] == 0 and pieces[-1][1] == p.numel()
        assert all(x[1] == y[0] for x, y in zip(pieces, pieces[1:]))


def test_a_buffer_of_two_dtypes_is_refused_in_one_line():
    buffers, gbuf_ranges = _stand_in(1, 0)
    gbuf_ranges[0] = {**gbuf_ranges[0], ("x", "y"): []}
    with pytest.raises(CheckpointError, match="DDP buffer 0 has 2 dtypes") as e:
        dist_ckpt.param_ranges(gbuf_ranges, buffers)
    assert "\n" not in str(e.value)


# -- which format a call asks for ---------------------------------------------------------
@pytest.mark.parametrize("kind", ["greenroom_streamed", "fully_reshardable", "dp_reshardable"])
def test_each_written_format_is_chosen_by_its_name(kind):
    assert dist_ckpt.resolve_sharding_type(None, {"distrib_optim_sharding_type": kind}) == kind
    assert dist_ckpt.resolve_sharding_type(kind, None) == kind


def test_no_sharding_type_is_refused_naming_the_formats_including_the_sidecar_one():
    with pytest.raises(CheckpointError) as e:
        dist_ckpt.resolve_sharding_type(None, None)
    msg = str(e.value)
    assert "\n" not in msg and "raises in stock megatron-core" in msg
    assert "'dp_reshardable'" in msg and "'fully_reshardable'" in msg
    assert "'greenroom_streamed'" in msg and "greenroom_optim/" in msg


@pytest.mark.parametrize("kind", ["fully_sharded_model_space", "dp_zero_gather_scatter", "fsdp_dtensor"])
def test_other_sharding_types_are_refused_in_one_line_naming_the_usable_ones(kind):
    with pytest.raises(CheckpointError) as e:
        dist_ckpt.resolve_sharding_type(None, {"distrib_optim_sharding_type": kind})
    msg = str(e.value)
    assert "\n" not in msg and repr(kind) in msg
    assert "'dp_reshardable'" in msg and "'fully_reshardable'" in msg


def test_stock_megatron_core_refuses_the_default_formats_tensors_itself():
    """Pins the claim of the refusal above: fully_sharded_model_space's tensors carry a
    flattened_range, which megatron-core's ShardedTensor refuses."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    with pytest.raises(CheckpointingException, match="flattened_range is not supported"):
        ShardedTensor(
            key="w",
            data=torch.zeros(4),
            dtype=torch.float32,
            local_shape=(4, 4),
            global_shape=(4, 4),
            global_offset=(0, 0),
            axis_fragmentations=None,
            flattened_range=slice(0, 4),
        )


# -- the moment dtype policy ----------------------------------------------------------
@pytest.mark.parametrize(
    ("record", "run"),
    [(None, "fp32"), (None, "bf16"), ({"moment_dtype": "fp32"}, "bf16"), ({"moment_dtype": "bf16"}, "bf16")],
)
def test_fp32_moments_load_anywhere_and_narrow_ones_into_their_own_dtype(record, run):
    dist_ckpt.check_moment_dtype(record, run)


@pytest.mark.parametrize("run", ["fp32", "fp16"])
def test_bf16_moments_are_refused_by_a_run_of_another_dtype_naming_the_flag(run):
    with pytest.raises(CheckpointError) as e:
        dist_ckpt.check_moment_dtype({"moment_dtype": "bf16"}, run)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.endswith("resume with --stream-optimizer-state-moment-dtype bf16")
    assert f"this run streams {run} moments" in msg


# -- the common part's step -------------------------------------------------------------
def test_param_groups_of_several_steps_or_another_count_are_refused():
    with pytest.raises(CheckpointError, match="2 optimizer param groups, this run 3"):
        dist_ckpt._one_step([{"step": 3.0}, {"step": 3.0}], 3)
    with pytest.raises(CheckpointError, match="not one whole number"):
        dist_ckpt._one_step([{"step": 3.0}, {"step": 4.0}], 2)
    with pytest.raises(CheckpointError, match="not one whole number"):
        dist_ckpt._one_step([{"lr": 1.0}], 1)
    assert dist_ckpt._one_step([{"step": 3.0}, {"step": 3.0}], 2) == 3


@pytest.mark.parametrize("kind", ["fully_reshardable", "dp_reshardable"])
def test_a_state_without_this_optimizers_template_is_refused(kind):
    """The stand-in optimizer carries only what the refusal reads: no pending template."""
    opt = SimpleNamespace(_mcore_load=None)
    with pytest.raises(CheckpointError, match="needs this optimizer's own template") as e:
        dist_ckpt.load_state_dict(opt, {"param_state_sharding_type": kind})
    assert "\n" not in str(e.value) and f"'distrib_optim_sharding_type': '{kind}'" in str(e.value)


# -- the wired methods on a real StreamingDistributedOptimizer, through dist_checkpointing --
FULLY = {"distrib_optim_sharding_type": "fully_reshardable"}
SAVED_STEP, SAVED_LR = 7, 5e-4


def _member(directory, msd, model, moment_dtype):
    """``mcore_support.member`` over a one-bucket stand-in DDP buffer."""
    from tests.megatron.mcore_support import member

    return member(directory, msd, model, moment_dtype)


def _wired_save(rank, world, ckpt, work, moment_dtype, decode_in_save=False):
    from megatron.core import dist_checkpointing

    from greenroom.megatron import DECODE_IN_SAVE, StreamedSaveStrategy, dist_ckpt
    from tests.megatron.mcore_support import gpt

    model = gpt(1, 1)
    msd = model.sharded_state_dict()
    by_param = by_param_of(msd)
    opt, streamed, resident = _member(os.path.join(work, f"save{rank}"), msd, model, moment_dtype)

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
    state = opt.sharded_state_dict(msd, metadata={**FULLY, DECODE_IN_SAVE: decode_in_save})
    if decode_in_save:  # bf16 moments: each bucket left to the strategy, which writes it once
        assert dist_ckpt.save_ways(opt)["defer"] == len(opt.store.buckets)
    strategy = StreamedSaveStrategy() if decode_in_save else None
    dist_checkpointing.save({"optimizer": state}, ckpt, sharded_strategy=strategy)
    opt.close()


def _wired_load(rank, world, ckpt, work, moment_dtype, saved_dtype):
    from megatron.core import dist_checkpointing

    from tests.megatron.mcore_support import gpt

    model = gpt(1, 1)
    msd = model.sharded_state_dict()
    by_param = by_param_of(msd)
    opt, streamed, resident = _member(os.path.join(work, f"load{rank}"), msd, model, moment_dtype)
    opt.store.initialize(lambda i: torch.zeros(opt.shard_entries[i].numel))
    opt._failed = "an earlier step() failed"  # a whole load cures the poison
    template = {"optimizer": opt.sharded_state_dict(msd, is_loading=True, metadata=dict(FULLY))}
    loaded = dist_checkpointing.load(template, ckpt)["optimizer"]
    staging = os.path.join(opt._state_dir.path, "mcore-load")
    if saved_dtype != "fp32" and moment_dtype != saved_dtype:
        with pytest.raises(CheckpointError) as e:
            opt.load_state_dict(loaded)
        assert "\n" not in str(e.value) and str(e.value).endswith(f"moment-dtype {saved_dtype}"), e.value
        assert os.listdir(staging) == [] and opt.streamed_steps == 0 and opt._failed is not None
        for state in opt.store.stream():  # the live state is as it was
            assert not state.master.any() and not state.exp_avg.float().any()
        opt.close()
        return
    opt.load_state_dict(loaded)
    assert os.listdir(staging) == []
    assert_loaded(opt, streamed, resident, by_param, moment_dtype, SAVED_STEP, SAVED_LR)
    opt.close()


@pytest.mark.parametrize(
    ("saved_dtype", "run_dtype", "load_world", "decode_in_save"),
    [
        ("fp32", "fp32", 3, False),
        ("fp32", "bf16", 1, False),
        ("bf16", "bf16", 1, False),
        ("bf16", "fp32", 1, False),
        ("bf16", "bf16", 1, True),
    ],
)
def test_the_wired_optimizer_saves_at_dp2_and_loads_at_another_dp(
    disk_dir, saved_dtype, run_dtype, load_world, decode_in_save
):
    from tests.megatron.mcore_support import spawn

    ckpt, work = os.path.join(disk_dir, "ckpt"), os.path.join(disk_dir, "work")
    os.makedirs(ckpt)
    cpu_save = not torch.cuda.is_available()
    spawn(_wired_save, 2, ckpt, work, saved_dtype, decode_in_save, cpu_save=cpu_save)
    spawn(_wired_load, load_world, ckpt, work, run_dtype, saved_dtype, cpu_save=cpu_save)
