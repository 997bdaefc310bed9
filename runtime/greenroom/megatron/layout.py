"""Which state of a DistributedOptimizer streams, and the topology it belongs to.

The DistributedOptimizer gives each DP rank a contiguous range of every DDP bucket; a
param that straddles a range boundary contributes only its slice (its *shard*). The
streamed state is the fp32 main copy and both Adam moments of this rank's shards of the
16-bit params, in the optimizer's own order (group by group, the order of
``shard_fp32_from_float16_groups``). Native fp32 params are not streamed: their shards
alias the model params and stay on the GPU under a small resident Adam.

``Topology`` is what a streamed checkpoint belongs to. The files hold this rank's DP
shard bytes in layout order, so they are only meaningful for the same TP/PP/DP/EP/CP
sizes and the same ranks; resume refuses anything else and names what changed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardEntry:
    """One 16-bit param's slice owned by this DP rank."""

    name: str
    """The param's name in its model chunk (``decoder.layers.0.mlp.linear_fc1.weight``)."""

    group: int
    """Index of the optimizer param group the shard belongs to."""

    index: int
    """Position of the shard in its group's ``shard_fp32_from_float16_groups`` list."""

    shape: tuple[int, ...]
    """Shape of the whole model param (the shard is a flat slice of it)."""

    start: int
    """First element of the slice within the flattened param."""

    numel: int
    """Number of elements in the slice."""

    def record(self) -> dict:
        out = asdict(self)
        out["shape"] = list(self.shape)
        return out


def plan_entries(gbuf_ranges, param_gbuf_map, opt_group_ranges, model_chunks) -> list[ShardEntry]:
    """The streamed shards, from the ranges megatron computes before it builds any main
    shard (``gbuf_ranges``, ``param_gbuf_map``, ``opt_group_ranges``), in its order."""
    import torch

    names = _param_names(model_chunks)
    entries = []
    for group, group_range in enumerate(opt_group_ranges):
        index = 0
        for model_param in group_range["params"]:
            if model_param.dtype not in (torch.float16, torch.bfloat16):
                continue  # native fp32: resident, not streamed
            gbuf_index, dtype, bucket_index = param_gbuf_map[model_param]
            shard = gbuf_ranges[gbuf_index][dtype][bucket_index]["param_map"][model_param]["param"]
            entries.append(
                ShardEntry(
                    name=names.get(model_param, f"group{group}.param{index}"),
                    group=group,
                    index=index,
                    shape=tuple(model_param.shape),
                    start=shard.start,
                    numel=shard.size,
                )
            )
            index += 1
    return entries


def _param_names(model_chunks) -> dict:
    names = {}
    for chunk_index, chunk in enumerate(model_chunks):
        prefix = f"chunk{chunk_index}." if len(model_chunks) > 1 else ""
        for name, param in chunk.named_parameters():
            names.setdefault(param, prefix + name)
    return names


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """The parallel layout a DP shard belongs to (sizes and this rank's coordinates)."""

    tp: int = 1
    """Tensor-parallel size."""

    pp: int = 1
    """Pipeline-parallel size."""

    dp: int = 1
    """Size of the DistributedOptimizer's data-parallel group (the shard count)."""

    ep: int = 1
    """Expert-parallel size."""

    cp: int = 1
    """Context-parallel size."""

    tp_rank: int = 0
    """This rank's tensor-parallel rank."""

    pp_rank: int = 0
    """This rank's pipeline stage."""

    dp_rank: int = 0
    """This rank's position in the DistributedOptimizer's data-parallel group."""

    ep_rank: int = 0
    """This rank's expert-parallel rank."""

    cp_rank: int = 0
    """This rank's context-parallel rank."""

    def record(self) -> dict:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict) -> "Topology":
        return cls(**{k: int(v) for k, v in record.items() if k in cls.__dataclass_fields__})

    def mismatch(self, saved: "Topology") -> str | None:
        """One line naming what differs between ``saved`` and this run, or None."""
        changed = [
            f"{name} {getattr(saved, name)} -> {getattr(self, name)}"
            for name in self.__dataclass_fields__
            if getattr(saved, name) != getattr(self, name)
        ]
        if not changed:
            return None
        return (
            "the streamed optimizer state was written with a different parallel layout ("
            + ", ".join(changed)
            + "); resume with the same TP/PP/DP/EP/CP sizes and ranks, "
            "or pass no_load_optim to start a fresh optimizer state"
        )


def current_topology(data_parallel_group=None) -> Topology:
    """This rank's topology from megatron's parallel state (1s where it is not set up)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    initialised = ps.model_parallel_is_initialized()

    def query(size_fn: str, rank_fn: str) -> tuple[int, int]:
        if not initialised:
            return 1, 0  # a single process without megatron's groups
        return int(getattr(ps, size_fn)()), int(getattr(ps, rank_fn)())

    tp, tp_rank = query("get_tensor_model_parallel_world_size", "get_tensor_model_parallel_rank")
    pp, pp_rank = query("get_pipeline_model_parallel_world_size", "get_pipeline_model_parallel_rank")
    ep, ep_rank = query("get_expert_model_parallel_world_size", "get_expert_model_parallel_rank")
    cp, cp_rank = query("get_context_parallel_world_size", "get_context_parallel_rank")
    if data_parallel_group is not None and dist.is_initialized():
        dp, dp_rank = dist.get_world_size(data_parallel_group), dist.get_rank(data_parallel_group)
    else:
        dp, dp_rank = query("get_data_parallel_world_size", "get_data_parallel_rank")
    return Topology(
        tp=tp,
        pp=pp,
        dp=dp,
        ep=ep,
        cp=cp,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        ep_rank=ep_rank,
        cp_rank=cp_rank,
    )
