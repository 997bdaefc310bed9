"""megatron-core's ``fully_reshardable`` optimizer format, written as one DP rank's slice.

Stock megatron-core's DistributedOptimizer, asked for ``fully_reshardable``, gathers the
whole DP group's state and emits, per model param, the full TP-local fp32 tensor of each
state under ``optimizer.state.{param|exp_avg|exp_avg_sq}.<the param's key in the model's
sharded state dict>``, with the model tensor's global shape and offsets. Every DP rank
of a streaming optimizer holds only its own contiguous flat slice of each param (the
``param`` range megatron keeps in ``gbuf_ranges[...]["param_map"]``), and gathering it
would put the DP group's state in one rank's memory. So the same keys are written here
as this rank's slice only, cut into boxes (``boxes``): a flat range of a row-major
tensor is a partial row, whole rows and a partial row, recursively, for any number of
dims. torch DCP takes the uneven chunks; a checkpoint of them loads into stock's
full-tensor template and the other way round, at any TP/PP/DP layout, because only the
keys, the global shapes and the covered elements must agree.

Two details the boxes need:

- megatron prepends axes (a layer's index in the stacked ``decoder.layers.*`` tensors)
  as ``prepend_axis_num``; with uneven chunks torch DCP's plan check fails on them, so
  they become real size-1 leading dims of each box.
- the replica id is the model tensor's with the DP coordinate (its last) set to 0: each
  DP rank's slice is the only copy of those elements, while TP-replicated params (layer
  norms) stay replicas across TP as in the model.

The rest of the optimizer's state dict is stock's common part (param groups with their
``step``, the grad scaler, ``param_state_sharding_type``), which ``dist_checkpointing``
writes to ``common.pt``, plus a ``greenroom`` record (format version, the moment dtype
the bytes were streamed as) that stock's ``load_state_dict`` does not read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from greenroom.errors import CheckpointError
from greenroom.megatron import dp_format

SHARDING_TYPE = "fully_reshardable"
FORMAT = "greenroom-mcore"
FORMAT_VERSION = 1
STATES = ("param", "exp_avg", "exp_avg_sq")
KEY_PREFIX = "optimizer.state"
METADATA_KEY = "distrib_optim_sharding_type"


@dataclass(frozen=True, kw_only=True, slots=True)
class OwnedSlice:
    """This DP rank's contiguous slice of one model param's flattened TP-local tensor."""

    param_index: int
    """The param's position in stock's order (buffer by buffer, ``param_index_map`` order):
    the key of its entry in ``param_state``."""

    model: Any
    """The param's ``ShardedTensor`` in the model's sharded state dict."""

    start: int
    """First element of the slice in the flattened TP-local param."""

    stop: int
    """One past its last element."""

    @property
    def numel(self) -> int:
        return self.stop - self.start


def owned_slices(model_sharded_state_dict, ranges: Iterable[tuple[Any, int, int]]) -> list[OwnedSlice]:
    """``ranges``: ``(model param, start, stop)`` in stock's param order (``start == stop``
    for a param this rank owns none of); each param is found in the model's sharded state
    dict (built with the params themselves as data, as megatron's modules build it).
    Params megatron-core's factories transform, or already flattened, are refused, naming them."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    by_param: dict[int, Any] = {}
    for sh in nested_values(model_sharded_state_dict):
        if isinstance(sh, (ShardedTensor, ShardedTensorFactory)) and sh.data is not None:
            by_param.setdefault(id(sh.data), sh)
    out = []
    for index, (param, start, stop) in enumerate(ranges):
        sh = by_param.get(id(param))
        if sh is None:
            raise CheckpointError(
                f"a param of shape {tuple(param.shape)} is not in the model's sharded state dict "
                "(build it with the params as data, as megatron's sharded_state_dict does)"
            )
        if isinstance(sh, ShardedTensorFactory):
            raise CheckpointError(
                f"{sh.key}: megatron-core builds this param's checkpoint tensors with a ShardedTensorFactory "
                "(e.g. a fused SwiGLU linear_fc1), which the streamed optimizer format does not cut into "
                "slices; use a model without it, or turn streaming off for the save"
            )
        if sh.flattened_range is not None:
            raise CheckpointError(f"{sh.key}: the model's sharded tensor is already flattened; it cannot be sliced")
        if not 0 <= start <= stop <= sh.data.numel():
            raise CheckpointError(f"{sh.key}: slice [{start}, {stop}) outside the param's {sh.data.numel()} elements")
        if stop > start:
            out.append(OwnedSlice(param_index=index, model=sh, start=start, stop=stop))
    return out


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """The flat range ``[start, stop)`` of a row-major tensor of ``shape`` as boxes:
    ``(first flat element, offset, shape)`` each, in flat order, covering it exactly."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [(start, (start,), (stop - start,))]
    inner = math.prod(shape[1:])
    first_row, first_col = divmod(start, inner)
    last_row, last_col = divmod(stop, inner)
    out = []

    def within(row: int, a: int, b: int) -> None:
        for flat, offset, box in boxes(shape[1:], a, b):
            out.append((row * inner + flat, (row, *offset), (1, *box)))

    if first_row == last_row:
        within(first_row, first_col, last_col)
        return out
    if first_col:
        within(first_row, first_col, inner)
        first_row += 1
    if last_row > first_row:
        out.append((first_row * inner, (first_row,) + (0,) * (len(shape) - 1), (last_row - first_row, *shape[1:])))
    if last_col:
        within(last_row, 0, last_col)
    return out


def _replica(replica_id):
    if isinstance(replica_id, tuple):
        return (*replica_id[:-1], 0)
    return 0


def slice_tensors(owned: OwnedSlice, key: str, flat: torch.Tensor) -> list:
    """``flat`` (this slice's elements of one state) as ShardedTensors under ``key``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sh = owned.model
    if flat.numel() != owned.numel:
        raise CheckpointError(f"{key}: {flat.numel()} elements given for a slice of {owned.numel}")
    pre = sh.prepend_axis_num
    out = []
    for first, offset, box in boxes(tuple(sh.local_shape), owned.start, owned.stop):
        local_shape = (1,) * pre + box
        lo = first - owned.start
        data = flat[lo : lo + math.prod(box)].view(local_shape)
        global_offset = tuple(sh.global_offset[:pre]) + tuple(g + o for g, o in zip(sh.global_offset[pre:], offset))
        out.append(
            ShardedTensor(
                key=key,
                data=data,
                dtype=data.dtype,
                local_shape=local_shape,
                global_shape=tuple(sh.global_shape),
                global_offset=global_offset,
                axis_fragmentations=None,
                replica_id=_replica(sh.replica_id),
                prepend_axis_num=0,
            )
        )
    return out


def param_state(slices: Iterable[OwnedSlice], data: Callable[[OwnedSlice, str], torch.Tensor]) -> dict:
    """``{param index: {state: [ShardedTensor, ...]}}``: every state of every owned slice,
    ``data(slice, state)`` giving its flat fp32 elements (views, never copies, for a
    bounded save; the tensors a load fills in place)."""
    return {
        s.param_index: {
            state: slice_tensors(s, f"{KEY_PREFIX}.{state}.{s.model.key}", data(s, state)) for state in STATES
        }
        for s in slices
    }


def greenroom_record(moment_dtype: str) -> dict:
    """What ``greenroom`` adds beside stock's common part."""
    return {"format": FORMAT, "version": FORMAT_VERSION, "moment_dtype": moment_dtype}


def common_state(param_groups: list[dict], step: int, *, moment_dtype: str, grad_scaler: dict | None = None) -> dict:
    """Stock's common part for torch's Adam: each param group without ``params`` and with
    the one ``step`` every param took, the grad scaler's state, and the greenroom record."""
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "step": step} for g in param_groups]
    state: dict = {"optimizer": {"param_groups": groups}}
    if grad_scaler is not None:
        state["grad_scaler"] = grad_scaler
    state["greenroom"] = greenroom_record(moment_dtype)
    return state


def sharded_optimizer_state(common: dict, param_state_dict: dict, sharding_type: str = SHARDING_TYPE) -> dict:
    """The optimizer's sharded state dict, laid out as stock's (for either format)."""
    return {**common, "param_state": param_state_dict, "param_state_sharding_type": sharding_type}


def check_saved(template: dict, saved_tensors: Mapping[str, Any], saved_common: Mapping | None, where: str) -> None:
    """Before a load: every key the template asks for is in the checkpoint with the same
    global shape (a checkpoint of another model, or without an optimizer, is refused
    naming the first key that differs), and a greenroom record, if any, is one this
    greenroom reads. A ``dp_reshardable`` bucket tensor missing or of another length is
    refused by ``dp_format``'s rule (its DDP buckets differ). ``saved_tensors``:
    ``dist_checkpointing.load_tensors_metadata``; ``saved_common``: the checkpoint's
    common state's optimizer part."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    record = (saved_common or {}).get("greenroom")
    if record is not None and (record.get("format") != FORMAT or record.get("version") != FORMAT_VERSION):
        raise CheckpointError(
            f"{where}: streamed optimizer format {record.get('format')!r} version {record.get('version')!r}; "
            f"this greenroom reads {FORMAT!r} version {FORMAT_VERSION}"
        )
    for sh in nested_values(template):
        if not isinstance(sh, ShardedTensor):
            continue
        saved = saved_tensors.get(sh.key)
        if dp_format.is_bucket_key(sh.key) and (saved is None or tuple(saved.global_shape) != tuple(sh.global_shape)):
            found = "none" if saved is None else f"{tuple(saved.global_shape)} elements"
            dp_format.refuse(where, f"{sh.key}: {found} in the checkpoint, {tuple(sh.global_shape)} in this run")
        if saved is None:
            raise CheckpointError(
                f"{where}: no {sh.key} in the checkpoint: it was written for another model, or without "
                "the optimizer's state in this sharding type; pass no_load_optim to start a fresh optimizer state"
            )
        if tuple(saved.global_shape) != tuple(sh.global_shape):
            raise CheckpointError(
                f"{where}: {sh.key} has global shape {tuple(saved.global_shape)} in the checkpoint, this "
                f"model's is {tuple(sh.global_shape)} (a checkpoint of another model)"
            )
