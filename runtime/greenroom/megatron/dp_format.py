"""megatron-core's ``dp_reshardable`` optimizer format: the DDP buckets' layout, as keys.

Megatron-LM's training loop saves the DistributedOptimizer in this format unless
``--dist-ckpt-optim-fully-reshardable`` is given. Its tensors live in DDP-bucket space,
not model space: per DDP buffer ``g`` (one ``(param dtype, grad dtype)`` each) and
bucket ``b``, one 1-D global tensor per state under
``optimizer.distributed.dp_group_idx_{i}.gbuf_idx_{g}.dtype_{dtype}.bucket_idx_{b}.{state}``,
as long as the bucket's unpadded elements (``bucket.numel_unpadded``). Each DP rank owns
the ``rank``-th of ``dp`` equal shards of the padded bucket (``gbuf_local`` ranges in
``gbuf_ranges``) and writes one piece per param it owns a slice of, at
``rank * shard + gbuf_local.start``, with replica id ``(instance id, 0, 0)``. Where
DDP's alignment leaves a gap between two params (or before this rank's first or after
its last) that lies before the bucket's unpadded end, a padding piece covers it, so
that the pieces of all ranks tile each global tensor. Each piece's dict also carries
``step`` and ``padding`` as ``LocalNonpersistentObject`` s, which are not saved.

Beside the buckets: ``per_bucket_numel`` and ``per_bucket_numel_unpadded`` (per buffer,
``{(param dtype, grad dtype): [per bucket]}``) as ``ShardedObject`` s, and the
optimizer's common part (param groups, grad scaler) as one ``ShardedObject`` per key;
each of those is written by DP rank 0 of its DP group (replica id
``(instance id, 0, dp rank)``).

The format reshards across DP only, and only where the DDP buckets' unpadded sizes stay
the same (same TP/PP, model, bucket size); ``check_buckets`` refuses anything else in
one line pointing at ``fully_reshardable``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from greenroom.errors import CheckpointError

SHARDING_TYPE = "dp_reshardable"
FULLY = "fully_reshardable"
STATES = ("param", "exp_avg", "exp_avg_sq")
NUMEL_KEYS = ("per_bucket_numel", "per_bucket_numel_unpadded")
KEY_PREFIX = "optimizer.distributed.dp_group_idx_"
BUCKET_MARK = ".gbuf_idx_"


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """One param's slice (or one gap) in this DP rank's shard of a DDP bucket."""

    gbuf_index: int
    dtype: Any
    """The buffer's key in ``gbuf_ranges``: ``(param dtype, grad dtype)``."""
    bucket_index: int
    local_start: int
    """First element in this rank's shard of the bucket (``gbuf_local``)."""
    local_stop: int
    global_offset: int
    """First element in the bucket's checkpoint tensor."""
    bucket_numel_unpadded: int
    """The checkpoint tensor's length."""
    param: Any = None
    """The model param, None for a padding piece."""
    param_start: int = 0
    """First element of the slice in the flattened param (``param`` range)."""
    position: int = 0
    """Its index in the bucket's list of pieces."""

    @property
    def numel(self) -> int:
        return self.local_stop - self.local_start

    @property
    def padding(self) -> bool:
        return self.param is None


def prefix(dp_group_idx: int) -> str:
    return f"{KEY_PREFIX}{dp_group_idx}"


def bucket_key(dp_group_idx: int, gbuf_index: int, dtype, bucket_index: int) -> str:
    return f"{prefix(dp_group_idx)}{BUCKET_MARK}{gbuf_index}.dtype_{dtype}.bucket_idx_{bucket_index}"


def is_bucket_key(key: str) -> bool:
    return key.startswith(KEY_PREFIX) and BUCKET_MARK in key


def layout(gbuf_ranges, buffers, dp_rank: int, dp_size: int) -> dict:
    """``{gbuf index: {dtype: [[Piece, ...] per bucket]}}`` of this DP rank, params in
    megatron's ``param_map`` order with the padding pieces between them.
    ``gbuf_ranges``: megatron's; ``buffers[g].buckets[b]``: DDP's buckets (``grad_data``,
    ``numel_unpadded``)."""
    out: dict = {}
    for g, by_dtype in enumerate(gbuf_ranges):
        if len(by_dtype) != 1:  # stock asserts the same
            raise CheckpointError(f"DDP buffer {g} has {len(by_dtype)} dtypes; megatron-core saves one")
        out[g] = {}
        for dtype, per_bucket in by_dtype.items():
            out[g][dtype] = [
                _bucket_pieces(g, dtype, b, ranges["param_map"], buffers[g].buckets[b], dp_rank, dp_size)
                for b, ranges in enumerate(per_bucket)
            ]
    return out


def _bucket_pieces(g, dtype, b, param_map, bucket, dp_rank: int, dp_size: int) -> list[Piece]:
    padded, unpadded = bucket.grad_data.numel(), bucket.numel_unpadded
    if padded % dp_size or unpadded > padded:
        raise CheckpointError(
            f"DDP buffer {g} bucket {b}: {padded} elements ({unpadded} unpadded) do not split into {dp_size} DP shards"
        )
    shard = padded // dp_size
    base = dp_rank * shard
    common = dict(gbuf_index=g, dtype=dtype, bucket_index=b, bucket_numel_unpadded=unpadded)
    params = [
        Piece(
            **common,
            local_start=r["gbuf_local"].start,
            local_stop=r["gbuf_local"].end,
            global_offset=base + r["gbuf_local"].start,
            param=param,
            param_start=r["param"].start,
        )
        for param, r in param_map.items()
    ]
    out: list[Piece] = []
    end = 0  # the end of the previous piece in this shard
    for nxt in [*params, None]:
        start = shard if nxt is None else nxt.local_start
        # a gap is covered where it begins before the bucket's unpadded end; the bucket's
        # end padding (which DP changes) is not in the checkpoint
        if start != end and base + end < unpadded:
            if base + start > unpadded:
                raise CheckpointError(
                    f"DDP buffer {g} bucket {b}: a gap [{base + end}, {base + start}) crosses the bucket's "
                    f"unpadded end {unpadded}"
                )
            out.append(Piece(**common, local_start=end, local_stop=start, global_offset=base + end))
        if nxt is not None:
            out.append(nxt)
            end = nxt.local_stop
    return [replace(p, position=k) for k, p in enumerate(out)]


def sharded_objects(values: dict, dp_group_idx: int, instance_id: int, dp_rank: int) -> dict:
    """Each value as the ``ShardedObject`` stock writes for a DP-dependent format: one
    per DP group (key ``optimizer.distributed.dp_group_idx_{i}.<name>``), saved by DP rank 0."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return {
        name: ShardedObject(f"{prefix(dp_group_idx)}.{name}", value, (1,), (0,), replica_id=(instance_id, 0, dp_rank))
        for name, value in values.items()
    }


def param_state(
    pieces: dict,
    data: Callable[[Piece, str], torch.Tensor],
    *,
    dp_group_idx: int,
    instance_id: int,
    dp_rank: int,
    numels: tuple,
    step: torch.Tensor,
) -> dict:
    """Stock's ``param_state`` dict for ``dp_reshardable``: the two bucket-size objects
    (``numels``: ``(per_bucket_numel, per_bucket_numel_unpadded)``) and, per buffer,
    dtype and bucket, a list of ``{param, step, exp_avg, exp_avg_sq, padding}`` dicts,
    ``data(piece, state)`` giving each piece's flat fp32 elements."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    def tensors(p: Piece) -> dict:
        key = bucket_key(dp_group_idx, p.gbuf_index, p.dtype, p.bucket_index)
        out: dict = {}
        for state in STATES:
            flat = data(p, state)
            if flat.shape != (p.numel,):
                raise CheckpointError(f"{key}.{state}: {tuple(flat.shape)} given for a piece of {p.numel}")
            out[state] = ShardedTensor(
                key=f"{key}.{state}",
                data=flat,
                dtype=flat.dtype,
                local_shape=(p.numel,),
                global_shape=(p.bucket_numel_unpadded,),
                global_offset=(p.global_offset,),
                axis_fragmentations=None,
                replica_id=(instance_id, 0, 0),
            )
        out["step"] = LocalNonpersistentObject(step)  # lives in the param groups, as stock's
        out["padding"] = LocalNonpersistentObject(p.padding)
        return out

    state: dict = sharded_objects(dict(zip(NUMEL_KEYS, numels)), dp_group_idx, instance_id, dp_rank)
    for g, by_dtype in pieces.items():
        state[g] = {dtype: [[tensors(p) for p in bucket] for bucket in buckets] for dtype, buckets in by_dtype.items()}
    return state


def check_buckets(ours, saved, where: str) -> None:
    """Stock's rule for a ``dp_reshardable`` load: the checkpoint's DDP buckets hold as
    many unpadded elements as this run's."""
    if saved == ours:
        return
    refuse(where, f"per_bucket_numel_unpadded {saved} in the checkpoint, {ours} in this run")


def refuse(where: str, what: str) -> None:
    raise CheckpointError(
        f"{where}: {what}: a '{SHARDING_TYPE}' optimizer checkpoint resumes only across DP with the same DDP "
        "buckets (same TP/PP, model and DDP bucket size); resume it at the layout it was saved at, and save it "
        f"with metadata={{'distrib_optim_sharding_type': '{FULLY}'}} (Megatron-LM: "
        f"--dist-ckpt-optim-fully-reshardable), which reshards across TP/PP/DP"
    )
