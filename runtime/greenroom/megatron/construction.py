"""What the construction of a ``StreamingDistributedOptimizer`` builds
(``greenroom.megatron.optimizer``): its bucket store, filled one fp32 main shard at a time.

Megatron builds one fp32 main shard per 16-bit param, all at once. Here its own builder
runs on one param at a time (``inner_optimizer.one_at_a_time``) and each new main shard
goes straight into the bucket files, after which its device storage is freed
(``resize_(0)``). The peak is the largest single shard; the tensor objects stay (megatron
and its grad clipping attach ``.grad`` to them and read their tensor-parallel attributes).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch

from greenroom.dirs.statedir import StateDir
from greenroom.megatron.class_swap import StreamingSettings
from greenroom.megatron.inner_optimizer import one_at_a_time
from greenroom.megatron.layout import plan_entries
from greenroom.optim.store.bucket_store import BucketStore, Entry

BUILDING: contextvars.ContextVar = contextvars.ContextVar("greenroom_megatron_building", default=None)
"""The ``Building`` of the DistributedOptimizer being constructed in this context; its
classmethod builder has no instance to read it from."""


@dataclass(kw_only=True, slots=True)
class Building:
    """One optimizer's construction: its block's settings and model chunks, and what the
    builder made (what a failed construction closes and releases)."""

    settings: StreamingSettings
    model_chunks: list
    entries: list | None = None
    store: BucketStore | None = None
    state_dir: StateDir | None = None


def build_main_param_groups(building: Building, builder, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
    """Megatron's ``_build_model_and_main_param_groups`` result, with every fp32 main
    shard of a 16-bit param in ``building``'s new store and its device storage freed;
    ``builder`` is megatron's own (the superclass's) method."""
    entries = plan_entries(gbuf_ranges, param_gbuf_map, opt_group_ranges, building.model_chunks)
    settings = building.settings
    device = torch.device("cuda", torch.cuda.current_device())
    building.entries = entries
    codec = settings.codec().codec
    # Each member of a chain (dense, expert) claims a dir of its own: optim/, optim-2/.
    building.state_dir = settings.claim()
    building.store = BucketStore(
        [Entry(name=e.name, shape=(e.numel,), group=e.group) for e in entries],
        building.state_dir.path,
        bucket_numel=settings.bucket_numel,
        moment_dtype=settings.config.stream_optimizer_state_moment_dtype,
        device=device,
        chunk_bytes=settings.config.chunk_bytes,
        compression=codec,
        host_cache_bytes=settings.config.host_cache_bytes,
    )
    result = tuple([[] for _ in opt_group_ranges] for _ in range(5))
    mains = one_at_a_time(builder, gbuf_ranges, param_gbuf_map, opt_group_ranges, config, result)
    previous = []

    def next_main(i: int) -> torch.Tensor:
        # The engine copies main i into its bucket before asking for i + 1, on the
        # same stream, so main i - 1's memory can go back to the allocator now.
        for main in previous:
            main.untyped_storage().resize_(0)
        previous[:] = [next(mains)]
        return previous[0]

    building.store.initialize(next_main)
    for main in previous:
        main.untyped_storage().resize_(0)
    for _ in mains:  # native-fp32 params after the last 16-bit one
        raise AssertionError("a 16-bit param was not planned as an entry")
    for group_range, fp32_shards, mains_of_group in zip(opt_group_ranges, result[3], result[4]):
        # The order megatron gives the inner optimizer: fp32 shards, then the mains.
        group_range["orig_group"]["params"] = [*fp32_shards, *mains_of_group]
    return result
