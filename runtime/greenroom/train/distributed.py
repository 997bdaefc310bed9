"""How the ranks of ``greenroom train`` work together: the model wrapped for data
parallelism (``--parallel ddp`` or ``fsdp``), and the run's reductions and barrier."""

from __future__ import annotations

import torch
import torch.distributed as dist

from greenroom.faults import kill_point


def parallelize(model: torch.nn.Module, *, parallel: str, world_size: int, device: torch.device) -> torch.nn.Module:
    """``model`` as this rank trains it: itself with one rank, else sharded with FSDP2
    (``parallel`` ``fsdp``) or wrapped in DDP."""
    if world_size == 1:
        return model
    kill_point("parallelize")  # the first collective: the other ranks wait in it for this one
    if parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world_size,))
        # FSDP2 shards one dtype per group: under ``mixed`` the fp32 norms get their own.
        for norm in (m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)):
            fully_shard(norm, mesh=mesh)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.nn.parallel import DistributedDataParallel

    # Bucket views: the grads the offloader moves are the DDP buckets themselves.
    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True
    )


class RankGroup:
    """The ranks of the run, from this one: reductions and a barrier over the process
    group (none needed, and none made, with one rank)."""

    def __init__(self, world_size: int, device: torch.device) -> None:
        self.world_size = world_size
        self.device = device

    def mean(self, *values: float) -> list[float]:
        return [v / self.world_size for v in self.reduce(values, dist.ReduceOp.SUM)]

    def reduce(self, values, op) -> list[float]:
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=op)
        return t.tolist()

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()
