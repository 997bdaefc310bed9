"""A run's memory, disk and time budget per rank and per node: what ``greenroom plan``
computes, before anything runs.

The parallel layout: ``world_size`` ranks, ``data_parallel`` replicas of the model, each
split over ``world_size / data_parallel`` model-parallel ranks (tensor, pipeline, expert:
any mix, since only the product matters for bytes). A rank holds ``params / model_parallel``
params' weights and grads, and their optimizer state unless ``sharding`` spreads it over
the data-parallel replicas (``optimizer``: ZeRO-1, Megatron's distributed optimizer;
``full``: FSDP/ZeRO-3, weights and grads too).

Per-param byte costs come from ``greenroom.optim.footprint``. Activations, the framework's
workspace and the CUDA context are not counted: the GPU figures are what the model state
takes, and a run needs headroom beyond them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from greenroom.config import OffloadFlags, moment_bytes_per_element
from greenroom.errors import ConfigError
from greenroom.io.compression import expected_ratio
from greenroom.optim.footprint import (
    GRAD_BYTES,
    MASTER_BYTES,
    PARAM_BYTES,
    REMAINDER_BYTES_PER_PARAM,
    RESIDENT_MOMENT_BYTES,
    has_master,
    resident_optimizer_bytes_per_param,
    streamed_bytes_per_param,
    streaming_device_bytes,
)
from greenroom.optim.store.layout import DEFAULT_BUCKET_NUMEL, DEVICE_BUFFERS
from greenroom.ranks import MAX_LAUNCHER_NUMBER

SHARDINGS = ("none", "optimizer", "full")
# Past these the byte figures (floats) overflow to inf or past what int() takes: an
# exabyte of params, and the most ranks torch.distributed and NCCL count.
MAX_PARAMS = 10**18
MAX_RANKS = MAX_LAUNCHER_NUMBER


@dataclass(kw_only=True, slots=True)
class Layout:
    """How the run is spread over its GPUs."""

    params: int
    world_size: int = 1
    nproc_per_node: int = 1
    data_parallel: int = 1
    sharding: str = "none"
    param_dtype: str = "bf16"

    def __post_init__(self) -> None:
        if not 0 < self.params <= MAX_PARAMS:
            raise ConfigError(f"--params {_shown(self.params)}: expected 1 to {MAX_PARAMS:.0e} (a quintillion params)")
        for flag, value in (
            ("--world-size", self.world_size),
            ("--nproc-per-node", self.nproc_per_node),
            ("--data-parallel", self.data_parallel),
        ):
            if not 0 < value <= MAX_RANKS:
                raise ConfigError(
                    f"{flag} must be a positive integer of at most {MAX_RANKS} (as torch.distributed "
                    f"counts ranks), got {_shown(value)}"
                )
        if self.world_size % self.data_parallel:
            raise ConfigError(
                f"--data-parallel {self.data_parallel} must divide --world-size {self.world_size} "
                "(the model-parallel degree is world size / data parallel)"
            )
        if self.nproc_per_node > self.world_size or self.world_size % self.nproc_per_node:
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node} must divide --world-size {self.world_size}")
        if self.sharding not in SHARDINGS:
            raise ConfigError(f"--sharding: expected one of {', '.join(SHARDINGS)}, got {self.sharding!r}")
        if self.param_dtype not in PARAM_BYTES:
            raise ConfigError(f"--param-dtype: expected one of {', '.join(PARAM_BYTES)}, got {self.param_dtype!r}")

    @property
    def model_parallel(self) -> int:
        return self.world_size // self.data_parallel

    @property
    def model_params_per_rank(self) -> float:
        """Params whose weights and grads a rank holds."""
        local = self.params / self.model_parallel
        return local / self.data_parallel if self.sharding == "full" else local

    @property
    def optimizer_params_per_rank(self) -> float:
        """Params whose optimizer state a rank holds."""
        local = self.params / self.model_parallel
        return local if self.sharding == "none" else local / self.data_parallel


def _shown(n: int) -> str:
    """``n`` for an error line: a number of hundreds of digits is cut to its length."""
    digits = str(n)
    return digits if len(digits) <= 24 else f"{digits[:6]}... ({len(digits)} digits)"


def _stored(nbytes: float, codec: str | None, kind: str) -> float:
    return nbytes / expected_ratio(codec, kind)


def rank_budget(layout: Layout, config: OffloadFlags, codec: str | None) -> dict:
    """Bytes per rank: on the GPU (with and without streaming), in host memory, on disk."""
    dtype = layout.param_dtype
    model_params, opt_params = layout.model_params_per_rank, layout.optimizer_params_per_rank
    weights = model_params * PARAM_BYTES[dtype]
    grads = model_params * GRAD_BYTES[dtype]
    master = has_master(dtype)
    resident_optimizer = opt_params * resident_optimizer_bytes_per_param(dtype)
    streaming = config.stream_optimizer_state_to_disk
    moments = config.stream_optimizer_state_moment_dtype if streaming else "fp32"
    # StreamingAdam stores a bf16 param's master as its low 16 bits (the master layout
    # ``remainder``); an fp16 param's master, and every master under ``fp32``, whole.
    remainder = streaming and dtype == "bf16" and config.stream_optimizer_state_master_layout == "remainder"
    optimizer = opt_params * (
        streamed_bytes_per_param(moments, master_on_disk=master, remainder=remainder)
        if streaming
        else resident_optimizer_bytes_per_param(dtype)
    )
    each_moment = opt_params * (moment_bytes_per_element(moments) if streaming else RESIDENT_MOMENT_BYTES)
    # A remainder's low mantissa bits are counted incompressible (no measured ratio).
    stored_master = (
        _stored(opt_params * REMAINDER_BYTES_PER_PARAM, None, "remainder")
        if remainder
        else _stored(opt_params * MASTER_BYTES, codec, "fp32 master")
    )
    optimizer_stored = (
        (stored_master if master else 0.0)
        + _stored(each_moment, codec, f"{moments} exp_avg")
        + _stored(each_moment, codec, f"{moments} exp_avg_sq")
    )
    bucket = min(DEFAULT_BUCKET_NUMEL, opt_params)
    buffers = min(DEVICE_BUFFERS, max(1, math.ceil(opt_params / DEFAULT_BUCKET_NUMEL)))
    gpu_resident = weights + grads + resident_optimizer
    gpu_streaming = weights + grads + streaming_device_bytes(bucket, moments, buffers=buffers, master_on_disk=master)
    # What a sleeping actor moves out: its weights and grads, and the optimizer state
    # when it lives on the device (streamed state is already on disk).
    actor = weights + grads + (0.0 if streaming else optimizer)
    actor_stored = _stored(weights + grads, codec, "bf16 weights") + (0.0 if streaming else optimizer_stored)
    offload = config.offload_train_target if config.offload_train else "off"
    host_cache = min(config.host_cache_bytes, optimizer) if streaming else 0.0
    pinned_copy = actor if offload == "cpu" else 0.0
    disk_streaming = optimizer if streaming else 0.0
    disk_offload = actor if offload == "disk" else 0.0
    stored_streaming = optimizer_stored if streaming else 0.0
    return {
        "model_params": model_params,
        "optimizer_params": opt_params,
        "weights": weights,
        "grads": grads,
        "optimizer_state": optimizer,
        "optimizer_state_stored": optimizer_stored,
        "gpu": {"without_streaming": gpu_resident, "with_streaming": gpu_streaming},
        "paused_actor": actor,
        "paused_actor_stored": actor_stored,
        "host": {
            "staging": float(config.staging_bytes_per_rank),
            "host_cache": host_cache,
            "pinned_actor_copy": pinned_copy,
            "total": config.staging_bytes_per_rank + host_cache + pinned_copy,
        },
        "disk": {"streaming": disk_streaming, "offload": disk_offload, "total": disk_streaming + disk_offload},
        "stored": {
            "streaming": stored_streaming,
            "offload": actor_stored if offload == "disk" else 0.0,
            "total": stored_streaming + (actor_stored if offload == "disk" else 0.0),
        },
        # A step reads and writes back the buckets the host cache does not hold.
        "streamed_per_step": stored_streaming * (1 - host_cache / optimizer) if streaming and optimizer else 0.0,
    }


def asleep_device_bytes(rank: dict, config: OffloadFlags) -> float:
    """Device bytes of model state the actor keeps while it sleeps: none where it offloads
    (weights, grads and a resident optimizer state leave; a streaming optimizer gives its
    bucket buffers back first), all of it where it does not."""
    if config.offload_train:
        return 0.0
    return rank["gpu"]["with_streaming" if config.stream_optimizer_state_to_disk else "without_streaming"]


# Note [node probe]
# ~~~~~~~~~~~~~~~~~
# A node's ranks share its disk, so plan gives each rank 1/N of the node's rates. Those rates
# must be the node's at N ranks' concurrency: a single-rank probe keeps 4 requests in flight,
# and a disk that serves more at once gives N ranks more than that probe shows (an H100's
# virtual disk read 0.94 GB/s beside its writes with one rank's requests in flight, 1.28 GB/s
# with 8 ranks', docs/benchmarks.md "Several ranks on one disk"). ``plan --measure-disk`` and
# ``bench node`` probe with ``bench.disk.node_bandwidth`` at the node's rank count, mixed
# reads and writes included; a streamed step reads its next buckets while it writes back the
# last ones, so where those mixed rates are known the step is the larger of its reads at the
# mixed read rate and its writes at the mixed write rate (``bench stream``'s overlapped
# bound). Rates given by hand have no mixed figure: the step is then its reads and writes one
# after the other, an upper end.


def seconds(
    rank: dict,
    *,
    nproc_per_node: int,
    read_gbps: float | None,
    write_gbps: float | None,
    offload_to_disk: bool,
    streaming: bool,
    mixed_gbps: tuple[float, float] | None = None,
) -> dict:
    """Expected seconds from the node's disk figures, shared by the node's ranks: a
    streamed step reads and writes back its buckets (with ``streaming``; at once at the
    ``mixed_gbps`` read and write rates where given, else one after the other), a sleep
    writes the paused actor, a wake reads it (Note [node probe])."""
    if read_gbps is None or write_gbps is None:
        return {}
    read = read_gbps * 1e9 / nproc_per_node
    write = write_gbps * 1e9 / nproc_per_node
    step = rank["streamed_per_step"]
    out = {"read_bytes_per_s_per_rank": read, "write_bytes_per_s_per_rank": write}
    if streaming:  # without it no step streams: no "streamed step 0.0 s"
        if not step:
            out["streamed_step"] = 0.0
        elif mixed_gbps is not None:
            mixed_read, mixed_write = (g * 1e9 / nproc_per_node for g in mixed_gbps)
            out["streamed_step"] = max(step / mixed_read, step / mixed_write)
        else:
            out["streamed_step"] = step / read + step / write
    if offload_to_disk:
        out.update(sleep=rank["paused_actor_stored"] / write, wake=rank["paused_actor_stored"] / read)
    return out
