"""``StreamingMuon.state_dict()`` / ``load_state_dict()`` in ``torch.optim.Muon``'s format.

The format::

    {"state": {i: {"momentum_buffer": t, "master": t}, ...},
     "param_groups": [{"lr": ..., "weight_decay": ..., "momentum": ..., "nesterov": ...,
                       "ns_coefficients": ..., "eps": ..., "ns_steps": ..., "adjust_lr_fn": ...,
                       "moment_dtype": "fp32", "params": [0, 1, ...]}, ...]}

``master`` (fp32) exists for 16-bit params only; only params with a momentum buffer have
state, as in torch. The tensors are views of the bucket files, as StreamingAdam's are
(``greenroom.optim.checkpoint.state_dict`` Note [state dict views], whose helpers this uses).
``load_state_dict`` checks everything before it writes; ``torch.optim.Muon``'s dicts
load, a 16-bit param's momentum (torch keeps it in the param's dtype) widened exactly
to fp32 storage.
"""

from __future__ import annotations

from typing import Any

import torch

from greenroom.optim.checkpoint.state_dict import (
    as_param_like,
    bucket_segments,
    check_groups,
    check_tensor,
    param_list,
    refusal,
    view_dtype,
)

_KEYS = ("momentum_buffer", "master")


def export_state_dict(opt) -> dict:
    moment_dtype = view_dtype(opt, "state_dict()")
    store = opt.store
    store.flush()
    index = {id(p): i for i, p in enumerate(param_list(opt))}
    where = {id(opt.streamed[i]): (bucket, k) for bucket in store.buckets for k, i in enumerate(bucket.entries)}
    maps: dict[int, dict] = {}
    state: dict[int, dict] = {}
    for p in param_list(opt):  # in param order, as StreamingAdam's (its state_dict.py says why)
        if p not in opt.state:
            continue
        bucket, k = where[id(p)]
        if bucket.index not in maps:
            maps[bucket.index] = bucket_segments(store, bucket, moment_dtype)
        segments = maps[bucket.index]
        start = bucket.offsets[k]
        out = {"momentum_buffer": as_param_like(segments["exp_avg"](start, p.numel()).view(p.shape), p)}
        if "master" in segments:
            out["master"] = segments["master"](start, p.numel()).view(p.shape)
        state[index[id(p)]] = out
    groups = []
    for g in opt.param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["moment_dtype"] = opt.moment_dtype
        packed["params"] = [index[id(p)] for p in g["params"]]
        groups.append(packed)
    return {"state": state, "param_groups": groups}


_fail = refusal("StreamingMuon.load_state_dict")


def import_state_dict(opt, state_dict: Any) -> None:
    moment_dtype = view_dtype(opt, "load_state_dict()")

    def check_group(gi: int, saved: dict) -> None:
        if saved.get("moment_dtype") not in (None, opt.moment_dtype):
            _fail(f"its momentum is {saved['moment_dtype']}, this optimizer stores {opt.moment_dtype}")

    position, recorded = check_groups(opt, state_dict, _fail, check_group)
    params = param_list(opt)
    checked: dict[int, dict] = {}
    for pid, pstate in state_dict["state"].items():
        if pid not in position:
            _fail(f"state for param id {pid!r}, which no param group lists")
        n = position[pid]
        p = params[n]
        if id(p) in opt.frozen:
            _fail(f"param {n} has state in the state dict but requires_grad=False here (no state kept)")
        if not isinstance(pstate, dict) or "momentum_buffer" not in pstate or set(pstate) - set(_KEYS):
            _fail(f"param {n}'s state must be a dict of momentum_buffer (and master for 16-bit params)")
        widen = p.dtype if recorded[n] is None and moment_dtype == torch.float32 else None
        got = {
            "momentum_buffer": check_tensor(
                _fail, f"param {n}'s momentum_buffer", pstate["momentum_buffer"], p.shape, moment_dtype, widen
            )
        }
        if "master" in pstate:
            if p.dtype == torch.float32:
                _fail(f"param {n} is fp32 (its own master) but the state dict has a master for it")
            got["master"] = check_tensor(_fail, f"param {n}'s master", pstate["master"], p.shape, torch.float32)
        checked[n] = got
    number = {id(p): n for n, p in enumerate(params)}
    opt.store.engine.drain()

    def fill(bucket_state) -> None:
        bucket = bucket_state.bucket
        bufs = bucket_state.views(bucket_state.exp_avg)
        masters = bucket_state.views(bucket_state.master) if bucket.master is not None else None
        for k, i in enumerate(bucket.entries):
            p = opt.streamed[i]
            got = checked.get(number[id(p)], {})
            if "momentum_buffer" in got:
                bufs[k].copy_(got["momentum_buffer"])
            if masters is not None:
                masters[k].copy_(got.get("master", p.detach()))

    # A failure from the first bucket written on poisons (optim.poison Note [a failed step poisons]).
    with opt._poisoned_if_it_fails("load_state_dict()", "partly loaded (some buckets from the state dict, some not)"):
        if checked or opt.state:
            opt.store.overwrite(fill)
        opt.state.clear()
        for n in checked:
            opt.state[params[n]] = {}
        for g, saved in zip(opt.param_groups, state_dict["param_groups"]):
            for key, value in saved.items():
                if key not in ("params", "param_names", "moment_dtype"):
                    g[key] = value
