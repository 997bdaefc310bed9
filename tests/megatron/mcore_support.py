"""What the CPU tests of the megatron-core checkpoint format share: gloo ranks, a small
real GPTModel, stock megatron-core's own DP range math over a stand-in DDP buffer, and
the analytic values every state element is saved with.

Stand-ins, and why: stock megatron-core's DistributedOptimizer (and so the streaming
one) cannot be built without CUDA (its DDP buffer and optimizer allocate on
``torch.cuda.current_device()`` and check ``torch.cuda.*Tensor`` types), so the DDP
buffer's layout is laid out here, one bucket, params in reverse order and padded to a
multiple of the DP size as DDP pads, and each DP rank's ranges come from stock's own
``DistributedOptimizer._build_model_gbuf_param_range_map`` over it.
"""

import os
import socket
import traceback
import zlib
from multiprocessing import forkserver
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STATES = ("param", "exp_avg", "exp_avg_sq")
PAD = 64  # DDP pads each buffer to a multiple of this times the DP size


# What the forkserver imports once, before its first fork: each rank then starts with
# torch and megatron-core imported (about 2 s per rank on an idle two-core machine, more
# under a test run) instead of importing them itself. No effect where this process has
# already started its forkserver.
PRELOAD = [
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.dist_checkpointing",
]


def spawn(fn, world: int, *args, cpu_save: bool = False) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; a rank's failure fails the call.
    The ranks fork from a fresh forkserver (which has imported ``PRELOAD``), not from
    pytest, whose other tests' I/O threads a fork would copy mid-lock. ``cpu_save``:
    ``stub_cuda_for_save`` in each rank."""
    forkserver.set_forkserver_preload(PRELOAD)
    mp.start_processes(_entry, args=(fn, world, _free_port(), args, cpu_save), nprocs=world, start_method="forkserver")


def spawn_nccl(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` NCCL ranks, rank r on GPU r; a rank's
    failure fails the call."""
    mp.start_processes(_nccl_entry, args=(fn, world, _free_port(), args), nprocs=world, start_method="spawn")


def _free_port() -> str:
    """A port free now: each spawn gets its own rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def _nccl_entry(rank, fn, world, port, args):
    torch.cuda.set_device(rank)
    _run_rank(rank, fn, world, port, args, "nccl", device_id=torch.device("cuda", rank))


def stub_cuda_for_save() -> None:
    """megatron-core 0.16.1's torch_dist save calls ``torch.cuda.synchronize()``
    (strategies/filesystem_async.py) and ``torch.cuda.current_device()``
    (strategies/state_dict_saver.py) even for CPU tensors; without CUDA both become
    no-ops on the CPU in this test rank. Nothing is changed where CUDA is present."""
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"


def _entry(rank, fn, world, port, args, cpu_save):
    if cpu_save:
        stub_cuda_for_save()
    _run_rank(rank, fn, world, port, args, "gloo")


def _run_rank(rank, fn, world, port, args, backend, **init) -> None:
    """Join the process group, run ``fn``, print its traceback (the parent only sees the
    exit code) and leave the group whatever happened."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group(backend, rank=rank, world_size=world, **init)
    try:
        fn(rank, world, *args)
    except BaseException:
        print(f"[rank {rank}]\n{traceback.format_exc()}", flush=True)
        raise
    finally:
        dist.destroy_process_group()


def gpt(tp: int, pp: int, hidden: int = 16):
    """A small real GPTModel at this rank's TP/PP coordinates (megatron's local layer spec)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=hidden,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
    )
    return GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=8,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )


def buffer_layout(model, model_sd, dp: int):
    """The stand-in DDP buffer: ``{param: (world start, world end, bucket 0)}`` in reverse
    param order (as DDP fills it), and the padded size."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    in_sd = {id(sh.data) for sh in nested_values(model_sd) if getattr(sh, "data", None) is not None}
    params = [p for p in model.parameters() if id(p) in in_sd][::-1]
    index_map, cursor = {}, 0
    for p in params:
        index_map[p] = (cursor, cursor + p.numel(), 0)
        cursor += p.numel()
    padded = -(-cursor // (PAD * dp)) * PAD * dp
    return index_map, padded


def dp_ranges(index_map, padded: int, dp: int, dp_rank: int):
    """``(param, start, stop)`` of DP rank ``dp_rank``, by stock megatron-core's range math."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    size = padded // dp
    param_map = DistributedOptimizer._build_model_gbuf_param_range_map(
        index_map, Range(dp_rank * size, (dp_rank + 1) * size), 0
    )
    out = []
    for p in index_map:
        got = param_map.get(p)
        out.append((p, got["param"].start, got["param"].end) if got else (p, 0, 0))
    return out


def full_value(key: str, state: str, global_shape) -> torch.Tensor:
    """The whole global tensor of ``state`` of ``key``: its flat index plus a per-(key,
    state) base, exact in fp32 for these sizes."""
    base = (zlib.crc32(f"{key}|{state}".encode()) % 1000) * 10000.0
    n = 1
    for d in global_shape:
        n *= d
    return (torch.arange(n, dtype=torch.float64) + base).to(torch.float32).reshape(global_shape)


def local_value(sh, state: str) -> torch.Tensor:
    """This rank's TP-local tensor of ``state`` for the model tensor ``sh``, flat."""
    return full_value(sh.key, state, tuple(sh.global_shape))[sh.global_slice()].reshape(-1)


def stock_stub(index_map, padded: int, world_tensors):
    """Stand-in for what stock's ``sharded_param_state_fully_reshardable`` reads of its
    optimizer: the buffers' ``param_index_map`` and the DP group's gathered state (stock
    gathers it from GPU buffers with NCCL; here it is given)."""
    dtype = torch.float32
    return SimpleNamespace(
        gbuf_ranges=[{dtype: [None]}],
        buffers=[SimpleNamespace(param_index_map=index_map, numel_unpadded=padded)],
        get_parameter_state_dp_zero=lambda **kw: {0: {dtype: world_tensors}},
    )


def stock_world(index_map, padded: int, model_sd) -> dict:
    """The gathered state stock would hold, filled with ``local_value`` at each param's place."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    by_param = {id(sh.data): sh for sh in nested_values(model_sd) if getattr(sh, "data", None) is not None}
    world = {s: torch.zeros(padded, dtype=torch.float32) for s in STATES}
    for p, (a, b, _) in index_map.items():
        for s in STATES:
            world[s][a:b] = local_value(by_param[id(p)], s)
    return world


def ddp_buffer(model, model_sd, dp: int, dp_rank: int, *, bucket_numel: int | None = None, align: int = 1):
    """A stand-in DDP buffer of the model's params (those in its sharded state dict),
    laid out as megatron's DDP lays out a distributed optimizer's buffer: params in
    reverse order, each starting at a multiple of ``align`` (the gaps are DDP's
    intra-param padding), cut into buckets of at least ``bucket_numel`` elements at param
    boundaries (one bucket if None), each padded at its end to a multiple of ``PAD * dp``;
    ``numel_unpadded`` is a bucket's size before that end padding (so DP does not change it)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    assert PAD % align == 0  # bucket starts stay aligned, so the gaps do not depend on DP
    in_sd = {id(sh.data) for sh in nested_values(model_sd) if getattr(sh, "data", None) is not None}
    params = [p for p in model.parameters() if id(p) in in_sd][::-1]
    index_map, buckets, cursor, bucket_start = {}, [], 0, 0
    for k, p in enumerate(params):
        cursor = -(-cursor // align) * align
        index_map[p] = (cursor, cursor + p.numel(), len(buckets))
        cursor += p.numel()
        if k == len(params) - 1 or (bucket_numel is not None and cursor - bucket_start >= bucket_numel):
            unpadded = cursor - bucket_start
            size = -(-unpadded // (PAD * dp)) * PAD * dp
            buckets.append(SimpleNamespace(grad_data=torch.empty(size), offset=bucket_start, numel_unpadded=unpadded))
            cursor = bucket_start = bucket_start + size
    group = SimpleNamespace(rank=lambda: dp_rank, size=lambda: dp)
    return SimpleNamespace(
        param_index_map=index_map,
        buckets=buckets,
        data_parallel_group=group,
        param_dtype=torch.bfloat16,
        grad_dtype=torch.float32,
    )


def gbuf_ranges(buffer):
    """megatron's own ``gbuf_ranges`` entry for the buffer (``_build_gbuf_range_map``)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return DistributedOptimizer._build_gbuf_range_map(buffer)


def bucket_numels(buffers):
    """``(per_bucket_numel, per_bucket_numel_unpadded)`` as megatron's DistributedOptimizer
    computes them from its buffers in its constructor."""
    key = lambda b: (b.param_dtype, b.grad_dtype)  # noqa: E731
    return (
        [{key(b): [bucket.grad_data.numel() for bucket in b.buckets]} for b in buffers],
        [{key(b): [bucket.numel_unpadded for bucket in b.buckets]} for b in buffers],
    )


def member(directory, msd, model, moment_dtype, *, bucket_numel=None, align=1):
    """A real StreamingDistributedOptimizer for its checkpoint methods (its constructor
    needs CUDA and megatron's DDP): a real BucketStore on real files, megatron's own
    ``gbuf_ranges`` over a stand-in DDP buffer of a real GPTModel's params
    (``ddp_buffer``), each owned param a streamed entry except the first in buffer order,
    which is a resident fp32 shard under the resident Adam, and an inner AdamW over
    [fp32 shard, mains]. Returns it, the streamed and the resident ``(param, start, stop)``."""
    from megatron.core import parallel_state as ps

    from greenroom.megatron import dist_ckpt
    from greenroom.megatron.inner_optimizer import resident_adam
    from greenroom.megatron.layout import ShardEntry
    from greenroom.megatron.optimizer import StreamingDistributedOptimizer
    from greenroom.optim.store.bucket_store import BucketStore, Entry

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    buffer = ddp_buffer(model, msd, dp, dp_rank, bucket_numel=bucket_numel, align=align)
    opt = object.__new__(StreamingDistributedOptimizer)
    opt.buffers = [buffer]
    opt.gbuf_ranges = [gbuf_ranges(buffer)]
    opt.per_bucket_numel, opt.per_bucket_numel_unpadded = bucket_numels(opt.buffers)
    opt.data_parallel_group = buffer.data_parallel_group
    opt.data_parallel_group_idx = dist.get_rank(ps.get_model_parallel_group())  # as get_megatron_optimizer sets it
    opt.distributed_optimizer_instance_id = 0
    owned = [(p, a, b) for p, a, b in dist_ckpt.param_ranges(opt.gbuf_ranges, opt.buffers) if b > a]
    first = next(iter(buffer.param_index_map))
    resident = [(p, a, b) for p, a, b in owned if p is first]
    streamed = [(p, a, b) for p, a, b in owned if p is not first]
    opt.shard_entries = [
        ShardEntry(name=f"p{k}", group=0, index=k, shape=tuple(p.shape), start=a, numel=b - a)
        for k, (p, a, b) in enumerate(streamed)
    ]
    opt.model_float16_groups = [[p for p, _, _ in streamed]]
    opt.model_fp32_groups = [[p for p, _, _ in resident]]
    opt.shard_fp32_groups = [[torch.zeros(b - a) for _, a, b in resident]]
    mains = [torch.zeros(b - a) for _, a, b in streamed]
    opt.optimizer = torch.optim.AdamW([{"params": [*opt.shard_fp32_groups[0], *mains]}], lr=1e-3)
    opt.resident_optimizer = resident_adam(opt.optimizer, opt.shard_fp32_groups)
    opt.grad_scaler = None
    opt.streamed_steps = 0
    os.makedirs(directory)
    opt._state_dir = SimpleNamespace(path=directory, release=lambda: None)  # the test owns the dir
    opt._store = BucketStore(
        [Entry(name=e.name, shape=(e.numel,)) for e in opt.shard_entries],
        directory,
        bucket_numel=300,
        moment_dtype=moment_dtype,
        chunk_bytes=1 << 20,
    )
    return opt, streamed, resident


def by_param_of(model_sd) -> dict:
    """The model's ShardedTensors by the id of the param they hold."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    return {id(sh.data): sh for sh in nested_values(model_sd) if getattr(sh, "data", None) is not None}


def saved_value(sharded, param, a: int, b: int, state: str, moment_dtype: str = "fp32") -> torch.Tensor:
    """Elements ``[a, b)`` of ``param``'s saved ``state`` (``local_value``), as a run with
    ``moment_dtype`` moments stores them: bf16 moments hold the bf16 values."""
    value = local_value(sharded[id(param)], state)[a:b]
    return value.bfloat16().float() if state != "param" and moment_dtype == "bf16" else value


def assert_loaded(opt, streamed, resident, sharded, moment_dtype: str, step: int, lr: float) -> None:
    """A whole load of the saved state into a ``member``: its step, its param group's lr
    (and no ``step`` there), every streamed entry's master and moments (the checkpoint's
    fp32 values, stored as this run's moment dtype stores them) and every resident shard
    with its Adam state, each ``torch.equal`` to ``saved_value``."""
    assert opt._failed is None and opt.streamed_steps == step
    assert opt.optimizer.param_groups[0]["lr"] == lr and "step" not in opt.optimizer.param_groups[0]
    for state in opt.store.stream():
        for k, m, e, s in zip(
            state.bucket.entries, state.views(state.master), state.views(state.exp_avg), state.views(state.exp_avg_sq)
        ):
            p, a, b = streamed[k]
            for name, got in (("param", m), ("exp_avg", e), ("exp_avg_sq", s)):
                assert torch.equal(got.float(), saved_value(sharded, p, a, b, name, moment_dtype)), (p.shape, name)
    for shard, (p, a, b) in zip(opt.shard_fp32_groups[0], resident):
        assert torch.equal(shard, saved_value(sharded, p, a, b, "param"))
        saved = opt.resident_optimizer.state[shard]
        assert float(saved["step"]) == step
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(saved[name], saved_value(sharded, p, a, b, name)), name
