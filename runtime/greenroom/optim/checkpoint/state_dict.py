"""``StreamingAdam.state_dict()`` / ``load_state_dict()`` in ``torch.optim.AdamW``'s format.

The format::

    {"state": {i: {"step": tensor, "exp_avg": t, "exp_avg_sq": t, "master": t}, ...},
     "param_groups": [{"lr": ..., "betas": ..., "eps": ..., "weight_decay": ..., "amsgrad": False,
                       ..., "moment_dtype": "fp32", "params": [0, 1, ...]}, ...]}

``i`` counts the params across the groups in order, as torch numbers them. ``master``
(fp32) exists for 16-bit params only. ``moment_dtype`` is the storage dtype of the
moments; the moment tensors have that dtype (fp32 or bf16), so a narrow state is never
read as fp32. As with torch, only params that have taken a step (or were loaded) have
state. FSDP2 params give DTensors of their local shards, so ``torch.distributed.checkpoint``
reshards them.

Note [state dict views]: the tensors are no host copy. Each is a view of its bucket
file through a private (copy-on-write) memory map: reading it reads the file, writing
it copies the page and never touches the file. ``torch.save(opt.state_dict(), f)``
therefore holds no anonymous memory for the state; the pages it reads are clean,
file-backed page cache, which the kernel drops under pressure (they show as RssFile
while mapped). Like torch's own state dict, the views are of the live state: take them
after a step and save or load them before the next one. fp16 and fp8 moments are stored
encoded (a square root, per-block scales) and have no such view: their state dict is
refused in one line; use ``save_checkpoint``. Compressed bucket files
(``--offload-train-disk-compression``) hold frames, not tensors: their buckets are
decoded into host memory instead, so the state dict then holds the rank's state once.
Masters stored as a remainder (``greenroom.optim.remainder`` Note [remainder], the
default for bf16 params) are in no file whole: they are rebuilt from the params into
host memory, so the state dict holds the rank's masters once (4 B/param) and is still
full fp32 masters in torch's format.

``load_state_dict`` checks everything first: the group layout, each group's keys, the
moment dtype, every tensor's shape and dtype. A state dict without a recorded moment
dtype (``torch.optim.AdamW``'s) may hold a 16-bit param's moments in the param's dtype,
as AdamW keeps them; they load into fp32 moments, which is exact. Any mismatch raises one line naming the
param and what differs, and nothing on disk has changed. Then it writes the buckets one
at a time (``BucketStore.overwrite``): what the state dict holds, zero moments for
params it has no state for, and masters from the current params where it has none (a
``torch.optim.AdamW`` state dict of 16-bit params).
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Callable, NoReturn

import torch

from greenroom.errors import GreenroomError
from greenroom.io.engine import verify_mapped
from greenroom.optim import remainder
from greenroom.optim.kernel import FIXED_GROUP_KEYS
from greenroom.tensors import local_tensor

_VIEW_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_MOMENTS = ("exp_avg", "exp_avg_sq")


def view_dtype(opt: torch.optim.Optimizer, what: str) -> torch.dtype:
    dtype = _VIEW_DTYPES.get(opt.moment_dtype)
    if dtype is None:
        raise GreenroomError(
            f"StreamingAdam.{what}: moment dtype {opt.moment_dtype} is stored encoded and has no "
            "torch state dict; use save_checkpoint/load_checkpoint, or moment_dtype fp32 or bf16"
        )
    return dtype


def param_list(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def as_param_like(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor shard of ``p`` when ``p`` is one (FSDP2), else itself."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


# -- export ----------------------------------------------------------------------------
def _map(path: str, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY)
    try:
        mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        mapped.madvise(mmap.MADV_SEQUENTIAL)  # read once, front to back: more readahead, early reclaim
        return mapped
    finally:
        os.close(fd)  # the mapping keeps the file


def bucket_segments(store, bucket, moment_dtype: torch.dtype, streamed: list[torch.Tensor] | None = None) -> dict:
    """Per segment (``master``, ``exp_avg``, ``exp_avg_sq``) a function ``(first element,
    count) -> flat host tensor`` over the bucket's state. Each segment is its own storage:
    torch.save refuses one storage viewed as two dtypes. ``streamed``: the param of each
    store entry, which a remainder bucket's masters are rebuilt from."""
    dtypes = {"master": torch.float32, "exp_avg": moment_dtype, "exp_avg_sq": moment_dtype}
    segments = {
        key: seg
        for key, seg in (("master", bucket.master), ("exp_avg", bucket.exp_avg), ("exp_avg_sq", bucket.exp_avg_sq))
        if seg is not None
    }
    if bucket.remainder:
        segments.pop("master")
    if store.compression is not None:
        # A compressed file holds frames, not the tensors: decode it into host memory
        # (the bound of Note [state dict views] does not hold for compressed state).
        data = torch.empty(bucket.data_bytes, dtype=torch.uint8)
        store.engine.read(data, store.files[bucket.index], 0).wait()
        decoded = {
            key: data[seg.offset : seg.offset + seg.nbytes].clone().view(dtypes[key]) for key, seg in segments.items()
        }
        if bucket.remainder:
            decoded["master"] = _rebuilt_masters(streamed, bucket, data)
        return {key: (lambda first, count, t=t: t[first : first + count]) for key, t in decoded.items()}
    mapped = _map(store.path(bucket.index), bucket.file_bytes)
    # The views are read around the I/O engine: check them against the file's checksums
    # now, or a flipped bit would go into the saved state unseen.
    verify_mapped(store.files[bucket.index], torch.frombuffer(mapped, dtype=torch.uint8, count=bucket.data_bytes))

    def view(seg, dtype):
        return lambda first, count: torch.frombuffer(
            mapped, dtype=dtype, count=count, offset=seg.offset + first * dtype.itemsize
        )

    out = {key: view(seg, dtypes[key]) for key, seg in segments.items()}
    if bucket.remainder:
        master = _rebuilt_masters(
            streamed, bucket, torch.frombuffer(mapped, dtype=torch.uint8, count=bucket.data_bytes)
        )
        out["master"] = lambda first, count: master[first : first + count]
    return out


def _rebuilt_masters(streamed: list[torch.Tensor], bucket, data: torch.Tensor) -> torch.Tensor:
    """A remainder bucket's fp32 masters, rebuilt in host memory from the params and the
    bucket's bytes ``data`` (Note [remainder]): the masters of such a bucket are in no
    file, so its state dict holds them once, 4 B/param of host memory."""
    master = torch.empty(bucket.numel, dtype=torch.float32)
    params = [(start, local_tensor(streamed[i]).detach().cpu()) for i, start in zip(bucket.entries, bucket.offsets)]
    low = data[bucket.master.offset : bucket.master.offset + bucket.master.nbytes].view(torch.int16)
    remainder.decode(master, low, data[bucket.fixups.offset : bucket.fixups.offset + bucket.fixups.nbytes], params)
    return master


def export_state_dict(opt: torch.optim.Optimizer) -> dict:
    """The state dict; see Note [state dict views]."""
    moment_dtype = view_dtype(opt, "state_dict()")
    store = opt.store
    store.flush()  # every write-back, and every cached bucket, is in the files before they are mapped
    index = {id(p): i for i, p in enumerate(param_list(opt))}
    where = {}  # id(param) -> (bucket, position in the bucket)
    for bucket in store.buckets:
        for k, i in enumerate(bucket.entries):
            where[id(opt.streamed[i])] = (bucket, k)
    maps: dict[int, dict] = {}
    state: dict[int, dict] = {}
    # In param order, as torch's: ``opt.state`` gains its entries in stream order, which
    # the kept bucket (optim.store.held Note [the last bucket stays]) changes from step
    # to step, so two optimizers of one state listed their params in different orders.
    for p in param_list(opt):
        pstate = opt.state.get(p)
        if pstate is None:
            continue
        local = local_tensor(p)
        out = {"step": pstate["step"]}
        if id(p) in where:
            bucket, k = where[id(p)]
            if bucket.index not in maps:
                maps[bucket.index] = bucket_segments(store, bucket, moment_dtype, opt.streamed)
            start, numel = bucket.offsets[k], local.numel()
            for key, segment in maps[bucket.index].items():
                out[key] = as_param_like(segment(start, numel).view(local.shape), p)
        elif "exp_avg" in pstate:  # resident
            out.update({key: as_param_like(pstate[key], p) for key in _MOMENTS})
        elif local.numel() == 0:  # an empty FSDP2 shard: empty tensors keep the keys alike on every rank
            empty = torch.empty(local.shape, dtype=torch.float32)
            out.update({key: as_param_like(empty.to(moment_dtype), p) for key in _MOMENTS})
            if p.dtype != torch.float32:
                out["master"] = as_param_like(empty, p)
        state[index[id(p)]] = out
    groups = []
    for g in opt.param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["moment_dtype"] = opt.moment_dtype
        # The kernel that ran, not the constructor's None: torch.optim.AdamW takes these
        # keys from a loaded state dict, and another kernel rounds differently.
        packed["fused"], packed["foreach"] = opt.fused, opt.foreach
        packed["params"] = [index[id(p)] for p in g["params"]]
        groups.append(packed)
    return {"state": state, "param_groups": groups}


# -- import (these checks are StreamingMuon's too: greenroom.optim.checkpoint.muon_state) ----------
def refusal(what: str) -> Callable[[str], NoReturn]:
    """How a load refuses: one line, ``what: msg; nothing was changed``."""

    def fail(msg: str) -> NoReturn:
        raise GreenroomError(f"{what}: {msg}; nothing was changed")

    return fail


_fail = refusal("StreamingAdam.load_state_dict")


def check_tensor(
    fail, name: str, value: Any, shape: torch.Size, dtype: torch.dtype, widen: torch.dtype | None = None
) -> torch.Tensor:
    """``value``'s local tensor, of ``shape`` and ``dtype`` (or ``widen``, which converts
    to ``dtype`` exactly); else ``fail``."""
    if not isinstance(value, torch.Tensor):
        fail(f"{name} is a {type(value).__name__}, expected a tensor")
    local = local_tensor(value)
    if tuple(local.shape) != tuple(shape):
        fail(f"{name} has shape {tuple(local.shape)}, this optimizer's is {tuple(shape)}")
    if local.dtype != dtype and local.dtype != widen:
        fail(f"{name} is {local.dtype}, this optimizer stores {dtype}")
    return local


def check_groups(opt, state_dict: Any, fail, check_group: Callable[[int, dict], None]) -> tuple[dict, list]:
    """The frame of a torch optimizer state dict checked against ``opt``: ``state`` and
    ``param_groups``, a saved group per group, each with as many params (and whatever
    ``check_group(index, saved group)`` checks besides). Returns ``{saved param id:
    position in opt's param list}`` and the ``moment_dtype`` each param's group recorded."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        fail("expected a dict with 'state' and 'param_groups' (an optimizer state dict)")
    groups, saved_groups = opt.param_groups, state_dict["param_groups"]
    if len(groups) != len(saved_groups):
        fail(f"the state dict has {len(saved_groups)} param groups, this optimizer {len(groups)}")
    ids, recorded = [], []
    for gi, (g, saved) in enumerate(zip(groups, saved_groups)):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
            fail(f"param group {gi} has no 'params' list")
        if len(saved["params"]) != len(g["params"]):
            fail(f"param group {gi} has {len(saved['params'])} params in the state dict, {len(g['params'])} here")
        check_group(gi, saved)
        ids.extend(saved["params"])
        recorded.extend([saved.get("moment_dtype")] * len(saved["params"]))
    return {pid: n for n, pid in enumerate(ids)}, recorded


def _check_adam_group(opt: torch.optim.Optimizer, gi: int, saved: dict) -> None:
    recorded = saved.get("moment_dtype")
    if recorded is not None and recorded != opt.moment_dtype:
        _fail(
            f"its moments are {recorded}, this optimizer stores {opt.moment_dtype} "
            f"(build it with moment_dtype={recorded!r})"
        )
    for key, allowed in FIXED_GROUP_KEYS.items():
        if key in saved and saved[key] != allowed:
            _fail(f"param group {gi} has {key}={saved[key]!r}, which StreamingAdam does not implement")


def _verify(opt: torch.optim.Optimizer, state_dict: Any, moment_dtype: torch.dtype) -> dict[int, dict]:
    """Every check, before anything changes; returns ``{param index: local tensors}``."""
    position, recorded_by_group = check_groups(
        opt, state_dict, _fail, lambda gi, saved: _check_adam_group(opt, gi, saved)
    )
    params = param_list(opt)
    resident = {id(p) for p in opt.resident}
    checked = {}
    for pid, pstate in state_dict["state"].items():
        if pid not in position:
            _fail(f"state for param id {pid!r}, which no param group lists")
        if not isinstance(pstate, dict):
            _fail(f"the state of param id {pid!r} is a {type(pstate).__name__}, expected a dict")
        n = position[pid]
        p = params[n]
        local = local_tensor(p)
        if id(p) in opt.frozen:
            _fail(f"param {n} has state in the state dict but requires_grad=False here (no state kept)")
        if "step" not in pstate:
            _fail(f"param {n} has no 'step'")
        step = pstate["step"]
        if not (isinstance(step, (int, float)) or (isinstance(step, torch.Tensor) and step.numel() == 1)):
            _fail(f"param {n}'s step is not a number")
        unknown = set(pstate) - {"step", "master", *_MOMENTS}
        if unknown:
            _fail(f"param {n} has state {sorted(unknown)} that StreamingAdam does not keep (amsgrad?)")
        if any(key in pstate for key in _MOMENTS) and not all(key in pstate for key in _MOMENTS):
            _fail(f"param {n} has only one of exp_avg and exp_avg_sq")
        want = torch.float32 if id(p) in resident else moment_dtype
        # torch.optim.AdamW keeps a 16-bit param's moments in the param's dtype; widening
        # them to fp32 storage is exact, so such a state dict (no moment dtype recorded) loads.
        widen = p.dtype if recorded_by_group[n] is None and want == torch.float32 else None
        tensors = {
            key: check_tensor(_fail, f"param {n}'s {key}", pstate[key], local.shape, want, widen)
            for key in _MOMENTS
            if key in pstate
        }
        if "master" in pstate:
            if p.dtype == torch.float32:
                _fail(f"param {n} is fp32 (its own master) but the state dict has a master for it")
            tensors["master"] = check_tensor(_fail, f"param {n}'s master", pstate["master"], local.shape, torch.float32)
        checked[n] = {"step": float(step), **tensors}
    return checked


def import_state_dict(opt: torch.optim.Optimizer, state_dict: Any) -> None:
    """Load ``state_dict`` (from ``export_state_dict`` or ``torch.optim.AdamW``)."""
    moment_dtype = view_dtype(opt, "load_state_dict()")
    checked = _verify(opt, state_dict, moment_dtype)
    params = param_list(opt)
    number = {id(p): n for n, p in enumerate(params)}
    store = opt.store
    store.engine.drain()

    def fill(bucket_state) -> None:
        bucket = bucket_state.bucket
        masters = bucket_state.views(bucket_state.master) if bucket.master is not None else [None] * len(bucket.entries)
        for k, i in enumerate(bucket.entries):
            p = opt.streamed[i]
            got = checked.get(number[id(p)], {})
            for key, flat in zip(_MOMENTS, (bucket_state.exp_avg, bucket_state.exp_avg_sq)):
                if key in got:
                    view = bucket_state.views(flat)[k]
                    view.copy_(got[key])
            if masters[k] is not None:
                masters[k].copy_(got.get("master", local_tensor(p).detach()))

    # From the first bucket written on, a failure leaves a state that is neither the run's
    # nor the dict's (optim.poison Note [a failed step poisons]).
    with opt._poisoned_if_it_fails("load_state_dict()", "partly loaded (some buckets from the state dict, some not)"):
        if checked or opt.state:
            store.overwrite(fill)
        # else: an empty state into an optimizer without state (accelerate's prepare round-trips
        # the fresh optimizer's dict): the files already hold zero moments, since state is
        # only ever empty when they do, and Note [masters follow the params] covers the masters.
        opt.state.clear()
        resident = {id(p) for p in opt.resident}
        for p in params:
            got = checked.get(number[id(p)])
            if got is None:
                continue
            state = opt.param_state(p)
            state["step"].fill_(got["step"])
            if id(p) in resident:
                local = local_tensor(p)
                for key in _MOMENTS:
                    state[key] = (
                        got[key].to(local.device, copy=True)
                        if key in got
                        else torch.zeros_like(local, memory_format=torch.preserve_format)
                    )
        for g, saved in zip(opt.param_groups, state_dict["param_groups"]):
            for key, value in saved.items():
                # Which kernel runs is this optimizer's choice (fused, foreach); the rest follows torch.
                if key not in ("params", "param_names", "moment_dtype", "fused", "foreach"):
                    g[key] = value
