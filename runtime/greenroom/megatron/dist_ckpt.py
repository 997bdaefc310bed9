"""The streaming DistributedOptimizer's state in megatron-core's own checkpoint.

``StreamingDistributedOptimizer.sharded_state_dict`` and ``load_state_dict`` call here.
Two formats, chosen as stock chooses (``metadata['distrib_optim_sharding_type']``):

``fully_reshardable`` (``mcore_format``)
    The streamed fp32 masters and Adam moments under stock megatron-core's own keys,
    this DP rank's slice of each param in boxes. The slices come from megatron's range
    structures, walked in stock's order (``param_ranges``); each is one store entry
    (a 16-bit param's streamed shard) or one resident native-fp32 shard (its value the
    shard, its moments the resident Adam's). Save: the store's buckets frozen and
    mapped (``staging.SaveViews``), held until the next step, save, load or ``close``,
    so that an async save's writer still reads them. Load: the template's tensors map
    staging files (``staging.LoadViews``) that ``dist_checkpointing.load`` fills;
    ``load_state_dict`` then checks the checkpoint's common part and the moment dtype,
    and only then writes the buckets one at a time through the engine (checksummed),
    the resident Adam, the step and the param groups. A load that fails before that
    leaves the run's state as it was; one that fails while writing poisons
    (``optim.poison`` Note [a failed step poisons]); a whole load cures the poison.

``greenroom_streamed`` (the sidecar format, ``greenroom.megatron.checkpoint``)
    Only the small state (param groups, the step, the grad scaler, the resident Adam)
    as ``ShardedObject``s; the bucket files go beside the checkpoint. Checkpoints
    written that way load with this type.

Moment dtypes: the checkpoint always holds fp32 values; a streamed checkpoint's
``greenroom`` record names the dtype the moments were streamed as. Those values are
only what the narrow bytes denote, so a run streaming another dtype (fp32 included)
refuses them in one line naming the flag; stock megatron-core, which does not read the
record, takes them as the fp32 values they are. fp32 moments (stock's, or streamed as
fp32) load into any run, encoded to its moment dtype as every step encodes them.
"""

from __future__ import annotations

import os
from collections import ChainMap
from dataclasses import dataclass, field

import torch

from greenroom.errors import CheckpointError
from greenroom.megatron import mcore_format as fmt
from greenroom.megatron.staging import LoadViews, SaveViews
from greenroom.optim import kernel

SHARDING_TYPE = fmt.SHARDING_TYPE
SIDECAR_SHARDING_TYPE = "greenroom_streamed"
MOMENT_FLAG = "--stream-optimizer-state-moment-dtype"
WHERE = "StreamingDistributedOptimizer.load_state_dict"


def resolve_sharding_type(sharding_type: str | None, metadata) -> str:
    """The format a ``sharded_state_dict`` call asks for: the sidecar format by its name,
    else ``mcore_format``'s resolution (its refusals, one line each, name the sidecar
    format where no type was given)."""
    chosen = sharding_type or (metadata or {}).get(fmt.METADATA_KEY)
    if chosen == SIDECAR_SHARDING_TYPE:
        return chosen
    try:
        return fmt.resolve_sharding_type(sharding_type, metadata)
    except CheckpointError as e:
        if chosen is not None:
            raise
        raise CheckpointError(
            f"{e}; a checkpoint with greenroom_optim/ beside it loads with "
            f"metadata={{'{fmt.METADATA_KEY}': '{SIDECAR_SHARDING_TYPE}'}}"
        ) from None


def param_ranges(gbuf_ranges, buffers) -> list[tuple]:
    """``(model param, start, stop)`` of this DP rank's slice of every param of every
    DDP buffer, in the order stock's ``fully_reshardable`` numbers them (buffer by
    buffer, ``param_index_map`` order); ``start == stop == 0`` for a param owned elsewhere.
    ``gbuf_ranges[g][dtype][bucket]['param_map'][param]['param']`` is megatron's range of
    the param's elements this rank owns, ``buffers[g].param_index_map`` its buffer order."""
    out = []
    for gbuf_index, by_dtype in enumerate(gbuf_ranges):
        if len(by_dtype) != 1:  # stock asserts the same
            raise CheckpointError(f"DDP buffer {gbuf_index} has {len(by_dtype)} dtypes; megatron-core saves one")
        for per_bucket in by_dtype.values():
            owned = ChainMap(*(bucket["param_map"] for bucket in per_bucket))
            for param in buffers[gbuf_index].param_index_map:
                got = owned.get(param)
                out.append((param, got["param"].start, got["param"].end) if got is not None else (param, 0, 0))
    return out


def check_moment_dtype(record, run_dtype: str) -> None:
    """Refuse moments streamed as a narrow dtype into a run that streams another one."""
    saved = (record or {}).get("moment_dtype", "fp32")
    if saved in ("fp32", run_dtype):
        return
    raise CheckpointError(
        f"{WHERE}: the checkpoint's Adam moments were streamed as {saved}, so its fp32 values are only what "
        f"{saved} bytes denote, and this run streams {run_dtype} moments; resume with {MOMENT_FLAG} {saved}"
    )


def _one_step(groups: list[dict], expected: int) -> int:
    if len(groups) != expected:
        raise CheckpointError(
            f"{WHERE}: the checkpoint has {len(groups)} optimizer param groups, this run {expected} "
            "(a checkpoint of another model or param grouping)"
        )
    steps = {g.get("step") for g in groups}
    if len(steps) != 1 or None in steps or float(next(iter(steps))) != int(next(iter(steps))):
        raise CheckpointError(
            f"{WHERE}: the param groups' steps {sorted(map(str, steps))} are not one whole number; "
            "the checkpoint was not written by torch's Adam under megatron-core's DistributedOptimizer"
        )
    return int(next(iter(steps)))


@dataclass(eq=False)
class _PendingLoad:
    """What a load template handed ``dist_checkpointing.load``, kept for ``load_state_dict``."""

    views: LoadViews
    flats: dict = field(default_factory=dict)
    """``(param index, state)`` -> the flat tensor the template's boxes of it view."""
    resident: dict = field(default_factory=dict)
    """param index -> the resident fp32 shard it loads into."""

    def fill_from(self, param_state: dict) -> None:
        """Copy what ``dist_checkpointing`` returned into the flats, unless it loaded in place."""
        for (index, state), flat in self.flats.items():
            pieces = (param_state.get(index) or {}).get(state)
            if pieces is None:
                raise CheckpointError(f"{WHERE}: the loaded param_state lacks {state} of param {index}")
            at = 0
            for piece in pieces:
                n = piece.numel()
                target = flat[at : at + n]
                if piece.data_ptr() != target.data_ptr():
                    target.copy_(piece.reshape(-1))
                at += n
            if at != flat.numel():
                raise CheckpointError(f"{WHERE}: {state} of param {index}: {at} elements loaded for {flat.numel()}")


def _sources(opt) -> dict[int, tuple]:
    """id(model param) -> (store entry index, None) or (None, resident fp32 shard)."""
    out = {}
    for i, e in enumerate(opt.shard_entries):
        out[id(opt.model_float16_groups[e.group][e.index])] = (i, None)
    for shards, params in zip(opt.shard_fp32_groups, opt.model_fp32_groups):
        for shard, param in zip(shards, params):
            out[id(param)] = (None, shard)
    return out


def _resident_value(opt, shard: torch.Tensor, state: str) -> torch.Tensor:
    if state == "param":
        return shard.detach().view(-1)
    saved = opt.resident_optimizer.state.get(shard) if opt.resident_optimizer is not None else None
    if not saved:  # never stepped: stock's moments are zeros then
        return torch.zeros(shard.numel(), dtype=torch.float32, device=shard.device)
    return saved[state].detach().view(-1)


def release(opt) -> None:
    """Drop a save's frozen maps and an unused load template's staging files."""
    save, opt._mcore_save = opt._mcore_save, None
    load, opt._mcore_load = opt._mcore_load, None
    try:
        if save is not None:
            save.close()
    finally:
        if load is not None:
            load.views.close()


def sharded_state_dict(opt, model_sharded_state_dict, is_loading: bool) -> dict:
    """The ``fully_reshardable`` sharded state dict of a streaming member (see the module doc)."""
    release(opt)
    slices = fmt.owned_slices(model_sharded_state_dict, param_ranges(opt.gbuf_ranges, opt.buffers))
    sources = _sources(opt)
    staging = os.path.join(opt._state_dir.path, "mcore-load" if is_loading else "mcore-save")
    views = LoadViews(opt.store, staging) if is_loading else SaveViews(opt.store, staging)
    pending = _PendingLoad(views) if is_loading else None

    def data(s: fmt.OwnedSlice, state: str) -> torch.Tensor:
        source = sources.get(id(s.model.data))
        if source is None:
            raise CheckpointError(f"{s.model.key}: in a DDP buffer of this optimizer but in none of its param groups")
        i, shard = source
        if i is not None:
            entry = opt.shard_entries[i]
            if (entry.start, entry.numel) != (s.start, s.numel):
                raise CheckpointError(
                    f"{s.model.key}: megatron's range [{s.start}, {s.stop}) differs from the streamed shard "
                    f"[{entry.start}, {entry.start + entry.numel})"
                )
            flat = views.entry(i, state)
        elif is_loading:
            flat = torch.empty(s.numel, dtype=torch.float32)
            pending.resident[s.param_index] = shard
        else:
            flat = _resident_value(opt, shard, state)
        if pending is not None:
            pending.flats[(s.param_index, state)] = flat
        return flat

    try:
        param_state = fmt.param_state(slices, data)
    except BaseException:
        views.close()
        raise
    if is_loading:
        opt._mcore_load = pending
    else:
        opt._mcore_save = views
    common = fmt.common_state(
        opt.optimizer.param_groups,
        float(opt.streamed_steps),  # torch's Adam counts in float; stock saves that value
        moment_dtype=opt.store.moment_dtype,
        grad_scaler=opt.grad_scaler.state_dict() if opt.grad_scaler else None,
    )
    return fmt.sharded_optimizer_state(common, param_state)


def load_state_dict(opt, state_dict: dict) -> None:
    """Load what ``dist_checkpointing.load`` returned for this member's ``fully_reshardable`` template."""
    pending, opt._mcore_load = opt._mcore_load, None
    if pending is None:
        raise CheckpointError(
            f"{WHERE}: a fully_reshardable state needs this optimizer's own template: pass "
            f"sharded_state_dict(model_sd, is_loading=True, metadata={{'{fmt.METADATA_KEY}': 'fully_reshardable'}}) "
            "to dist_checkpointing.load and load what it returns"
        )
    try:
        fmt.check_saved({}, {}, state_dict, WHERE)  # the greenroom record, if any, is one this greenroom reads
        check_moment_dtype(state_dict.get("greenroom"), opt.store.moment_dtype)
        groups = state_dict["optimizer"]["param_groups"]
        step = _one_step(groups, len(opt.optimizer.param_groups))
        pending.fill_from(state_dict["param_state"])
    except BaseException:
        pending.views.close()
        raise
    with opt._poisoned_if_it_fails("load_state_dict()", "partly loaded (some buckets from the checkpoint, some not)"):
        try:
            pending.views.apply()
        finally:
            pending.views.close()
        for group, saved in zip(opt.optimizer.param_groups, groups):
            group.update({k: v for k, v in saved.items() if k not in ("params", "step")})
        opt.streamed_steps = step
        _load_resident(opt, pending, step)
        if opt.grad_scaler and "grad_scaler" in state_dict:
            opt.grad_scaler.load_state_dict(state_dict["grad_scaler"])
    opt._state_replaced()


def _load_resident(opt, pending: _PendingLoad, step: int) -> None:
    resident = opt.resident_optimizer
    if resident is None:
        return
    resident.state.clear()
    for index, shard in pending.resident.items():
        shard.copy_(pending.flats[(index, "param")].view_as(shard))
        resident.state[shard] = {
            "step": kernel.new_step(torch.device("cpu"), fused=False).fill_(float(step)),
            "exp_avg": pending.flats[(index, "exp_avg")].to(shard.device).view_as(shard),
            "exp_avg_sq": pending.flats[(index, "exp_avg_sq")].to(shard.device).view_as(shard),
        }


def sidecar_state(opt) -> dict:
    """The sidecar format's part in megatron's checkpoint: the small state as one
    ``ShardedObject`` per key per DP group (saved by DP rank 0, as megatron's own
    DP-dependent formats do), and no param state."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sharded = {
        key: ShardedObject(
            f"optimizer.distributed.dp_group_idx_{opt.data_parallel_group_idx}.{key}",
            value,
            (1,),
            (0,),
            replica_id=(opt.distributed_optimizer_instance_id, 0, opt.data_parallel_group.rank()),
        )
        for key, value in opt._small_state().items()
    }
    sharded["param_state_sharding_type"] = SIDECAR_SHARDING_TYPE
    return sharded
