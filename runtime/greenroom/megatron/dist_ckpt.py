"""The streaming DistributedOptimizer's state in megatron-core's own checkpoint.

``StreamingDistributedOptimizer.sharded_state_dict`` and ``load_state_dict`` call here.
Three formats, chosen as stock chooses (``metadata['distrib_optim_sharding_type']``,
resolved once by ``resolve_sharding_type``):

``fully_reshardable`` (``mcore_format``) and ``dp_reshardable`` (``dp_format``)
    The streamed fp32 masters and Adam moments under stock megatron-core's own keys for
    that format: this DP rank's slice of each param, as boxes of the model tensor
    (``fully_reshardable``) or as pieces of its DDP bucket (``dp_reshardable``). The
    slices come from megatron's range structures (``gbuf_ranges``); each is one store
    entry (a 16-bit param's streamed shard) or one resident native-fp32 shard (its value
    the shard, its moments the resident Adam's). Save: the store's buckets frozen and
    mapped (``staging.SaveViews``), held until the next step, save, load or ``close``,
    so that an async save's writer still reads them. Load: the template's tensors map
    staging files (``staging.LoadViews``) that ``dist_checkpointing.load`` fills;
    ``load_state_dict`` then checks the checkpoint's common part, the moment dtype and
    (``dp_reshardable``) the DDP buckets' sizes, and only then writes the buckets one at
    a time through the engine (checksummed), the resident Adam, the step and the param
    groups. A load that fails before that leaves the run's state as it was; one that
    fails while writing poisons (``optim.poison`` Note [a failed step poisons]); a whole
    load cures the poison.

``greenroom_streamed`` (the sidecar format, ``greenroom.megatron.checkpoint``)
    Only the small state (param groups, the step, the grad scaler, the resident Adam)
    as ``ShardedObject``s; the bucket files go beside the checkpoint. Checkpoints
    written that way load with this type.

Moment dtypes: the checkpoint always holds fp32 values; a streamed checkpoint's
``greenroom`` record (in the common part, which ``dist_checkpointing`` writes to
``common.pt`` for both stock formats) names the dtype the moments were streamed as.
Those values are only what the narrow bytes denote, so a run streaming another dtype
(fp32 included) refuses them in one line naming the flag; stock megatron-core, which
does not read the record, takes them as the fp32 values they are. fp32 moments (stock's,
or streamed as fp32) load into any run, encoded to its moment dtype as every step
encodes them.
"""

from __future__ import annotations

import os
from collections import ChainMap
from dataclasses import dataclass, field

import torch

from greenroom.errors import CheckpointError
from greenroom.megatron import dp_format
from greenroom.megatron import mcore_format as fmt
from greenroom.megatron.staging import LoadViews, SaveViews
from greenroom.optim import kernel

FULLY = fmt.SHARDING_TYPE
DP = dp_format.SHARDING_TYPE
SIDECAR_SHARDING_TYPE = "greenroom_streamed"
STOCK_DEFAULT = "fully_sharded_model_space"
MCORE_TYPES = (FULLY, DP)
MOMENT_FLAG = "--stream-optimizer-state-moment-dtype"
WHERE = "StreamingDistributedOptimizer.load_state_dict"


def resolve_sharding_type(sharding_type: str | None, metadata) -> str:
    """The format a ``sharded_state_dict`` call asks for, as stock resolves it
    (``sharding_type``, else ``metadata['distrib_optim_sharding_type']``), refused in one
    line unless it is one of ``MCORE_TYPES`` or the sidecar format. Stock's own default
    when neither names one, ``fully_sharded_model_space``, raises inside megatron-core
    0.16.1 and 0.19.2 (its ShardedTensors carry a ``flattened_range``, which
    ``ShardedTensor`` refuses), so it is refused here too."""
    chosen = sharding_type or (metadata or {}).get(fmt.METADATA_KEY)
    if chosen in (*MCORE_TYPES, SIDECAR_SHARDING_TYPE):
        return chosen
    pass_it = f"pass metadata={{'{fmt.METADATA_KEY}': '{DP}'}}"
    if chosen in (None, STOCK_DEFAULT):
        raise CheckpointError(
            f"optimizer sharding type {STOCK_DEFAULT!r} (megatron-core's default when metadata names none) "
            "raises in stock megatron-core 0.16.1 and 0.19.2 too (ShardedTensor.flattened_range is not supported); "
            f"{pass_it} (Megatron-LM's default) or '{FULLY}' (--dist-ckpt-optim-fully-reshardable)"
            + (
                f"; a checkpoint with greenroom_optim/ beside it loads with "
                f"metadata={{'{fmt.METADATA_KEY}': '{SIDECAR_SHARDING_TYPE}'}}"
                if chosen is None
                else ""
            )
        )
    raise CheckpointError(
        f"optimizer sharding type {chosen!r}: the streamed DistributedOptimizer writes '{DP}', '{FULLY}' "
        f"and '{SIDECAR_SHARDING_TYPE}' only; {pass_it} (Megatron-LM's default) or '{FULLY}'"
    )


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
    sharding_type: str
    flats: dict = field(default_factory=dict)
    """The path of a state's tensors in the loaded ``param_state`` -> the flat tensor they view."""
    resident: dict = field(default_factory=dict)
    """id(resident fp32 shard) -> (the shard, {state: the flat tensor it loads from})."""

    def fill_from(self, param_state: dict) -> None:
        """Copy what ``dist_checkpointing`` returned into the flats, unless it loaded in place."""
        for path, flat in self.flats.items():
            got = param_state
            for step in path:
                got = got.get(step) if isinstance(got, dict) else (got[step] if step < len(got) else None)
                if got is None:
                    raise CheckpointError(f"{WHERE}: the loaded param_state lacks {'/'.join(map(str, path))}")
            at = 0
            for piece in got if isinstance(got, list) else [got]:
                n = piece.numel()
                target = flat[at : at + n]
                if piece.data_ptr() != target.data_ptr():
                    target.copy_(piece.reshape(-1))
                at += n
            if at != flat.numel():
                raise CheckpointError(f"{WHERE}: {'/'.join(map(str, path))}: {at} elements loaded for {flat.numel()}")


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


def save_ways(opt) -> dict[str, int] | None:
    """How the last stock-format save froze the buckets: counts of ``link``, ``copy`` and
    ``decode`` (``staging.SaveViews``); None when no save holds frozen maps."""
    return None if opt._mcore_save is None else dict(opt._mcore_save.ways)


class _Slices:
    """The flat fp32 tensor of each state of each param slice a format's pieces name:
    a view of the frozen (save) or staging (load) bucket maps for a streamed shard, the
    resident shard and its Adam's moments (save) or a tensor to load them into."""

    def __init__(self, opt, views, pending: _PendingLoad | None) -> None:
        self.opt, self.views, self.pending = opt, views, pending
        self.sources = _sources(opt)

    def __call__(self, name: str, param, start: int, numel: int, state: str, path: tuple) -> torch.Tensor:
        source = self.sources.get(id(param))
        if source is None:
            raise CheckpointError(f"{name}: in a DDP buffer of this optimizer but in none of its param groups")
        i, shard = source
        if i is not None:
            entry = self.opt.shard_entries[i]
            if (entry.start, entry.numel) != (start, numel):
                raise CheckpointError(
                    f"{name}: megatron's range [{start}, {start + numel}) differs from the streamed shard "
                    f"[{entry.start}, {entry.start + entry.numel})"
                )
            flat = self.views.entry(i, state)
        elif self.pending is not None:
            flat = torch.empty(numel, dtype=torch.float32)
            self.pending.resident.setdefault(id(shard), (shard, {}))[1][state] = flat
        else:
            flat = _resident_value(self.opt, shard, state)
        if self.pending is not None:
            self.pending.flats[path] = flat
        return flat


def sharded_state_dict(
    opt, model_sharded_state_dict, is_loading: bool, sharding_type: str, decode_in_save: bool = False
) -> dict:
    """The ``fully_reshardable`` or ``dp_reshardable`` sharded state dict of a streaming
    member (see the module doc); ``decode_in_save``: for ``StreamedSaveStrategy``, which
    decodes the buckets that are not fp32 tensors itself (staging Note [decode in the save])."""
    release(opt)
    staging = os.path.join(opt._state_dir.path, "mcore-load" if is_loading else "mcore-save")
    views = LoadViews(opt.store, staging) if is_loading else SaveViews(opt.store, staging, defer=decode_in_save)
    pending = _PendingLoad(views, sharding_type) if is_loading else None
    try:
        slices = _Slices(opt, views, pending)
        if sharding_type == DP:
            param_state = _dp_param_state(opt, slices, is_loading)
        else:
            param_state = _fully_param_state(opt, model_sharded_state_dict, slices)
    except BaseException:
        views.close()
        raise
    if is_loading:
        opt._mcore_load = pending
    else:
        opt._mcore_save = views
        views.own_maps(param_state)
        views.note_deferred(param_state)
    common = fmt.common_state(
        opt.optimizer.param_groups,
        float(opt.streamed_steps),  # torch's Adam counts in float; stock saves that value
        moment_dtype=opt.store.moment_dtype,
        grad_scaler=opt.grad_scaler.state_dict() if opt.grad_scaler else None,
    )
    if sharding_type == DP:  # stock's DP-dependent formats carry the common part per DP group
        record = common.pop("greenroom")  # stays plain: common.pt, which stock's template does not ask for
        common = {**_dp_objects(opt, common), "greenroom": record}
    return fmt.sharded_optimizer_state(common, param_state, sharding_type)


def _fully_param_state(opt, model_sharded_state_dict, slices: _Slices) -> dict:
    owned = fmt.owned_slices(model_sharded_state_dict, param_ranges(opt.gbuf_ranges, opt.buffers))
    return fmt.param_state(
        owned,
        lambda s, state: slices(s.model.key, s.model.data, s.start, s.numel, state, (s.param_index, state)),
    )


def _dp_param_state(opt, slices: _Slices, is_loading: bool) -> dict:
    group = opt.data_parallel_group
    pieces = dp_format.layout(opt.gbuf_ranges, opt.buffers, group.rank(), group.size())
    zeros = torch.zeros(max((p.numel for b in _all(pieces) for p in b if p.padding), default=0))

    def data(p: dp_format.Piece, state: str) -> torch.Tensor:
        if p.padding:  # no state: stock writes what its buffer holds there
            return torch.zeros(p.numel) if is_loading else zeros[: p.numel]
        path = (p.gbuf_index, p.dtype, p.bucket_index, p.position, state)
        name = f"{dp_format.bucket_key(opt.data_parallel_group_idx, *path[:3])} at {p.global_offset}"
        return slices(name, p.param, p.param_start, p.numel, state, path)

    return dp_format.param_state(
        pieces,
        data,
        dp_group_idx=opt.data_parallel_group_idx,
        instance_id=opt.distributed_optimizer_instance_id,
        dp_rank=group.rank(),
        numels=(opt.per_bucket_numel, opt.per_bucket_numel_unpadded),
        step=torch.tensor(float(opt.streamed_steps)),
    )


def _all(pieces: dict):
    for by_dtype in pieces.values():
        for buckets in by_dtype.values():
            yield from buckets


def _dp_objects(opt, values: dict) -> dict:
    return dp_format.sharded_objects(
        values, opt.data_parallel_group_idx, opt.distributed_optimizer_instance_id, opt.data_parallel_group.rank()
    )


@torch.no_grad()  # the resident shards are views of params that require grad
def load_state_dict(opt, state_dict: dict) -> None:
    """Load what ``dist_checkpointing.load`` returned for this member's own template."""
    pending, opt._mcore_load = opt._mcore_load, None
    kind = state_dict.get("param_state_sharding_type")
    if pending is None or pending.sharding_type != kind:
        if pending is not None:
            pending.views.close()
        raise CheckpointError(
            f"{WHERE}: a {kind} state needs this optimizer's own template of that type: pass "
            f"sharded_state_dict(model_sd, is_loading=True, metadata={{'{fmt.METADATA_KEY}': '{kind}'}}) "
            "to dist_checkpointing.load and load what it returns"
        )
    try:
        fmt.check_saved({}, {}, state_dict, WHERE)  # the greenroom record, if any, is one this greenroom reads
        check_moment_dtype(state_dict.get("greenroom"), opt.store.moment_dtype)
        groups = state_dict["optimizer"]["param_groups"]
        step = _one_step(groups, len(opt.optimizer.param_groups))
        if kind == DP:
            saved = state_dict["param_state"].get(dp_format.NUMEL_KEYS[1])
            dp_format.check_buckets(opt.per_bucket_numel_unpadded, saved, WHERE)
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
    for shard, flats in pending.resident.values():
        shard.copy_(flats["param"].view_as(shard))
        resident.state[shard] = {
            "step": kernel.new_step(torch.device("cpu"), fused=False).fill_(float(step)),
            "exp_avg": flats["exp_avg"].to(shard.device).view_as(shard),
            "exp_avg_sq": flats["exp_avg_sq"].to(shard.device).view_as(shard),
        }


def sidecar_state(opt) -> dict:
    """The sidecar format's part in megatron's checkpoint: the small state as one
    ``ShardedObject`` per key per DP group (saved by DP rank 0, as megatron's own
    DP-dependent formats do), and no param state."""
    return {**_dp_objects(opt, opt._small_state()), "param_state_sharding_type": SIDECAR_SHARDING_TYPE}
