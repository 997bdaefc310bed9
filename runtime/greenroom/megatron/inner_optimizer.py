"""What the streaming DistributedOptimizer does with megatron's inner torch optimizer: its
kernel choice, the small resident Adam beside it for native-fp32 shards, the hyperparameters
the two share, the stand-in for its step during megatron's own, and megatron's main-shard
builder run on one param at a time."""

from __future__ import annotations

import inspect

import torch
from torch.optim.optimizer import _default_to_fused_or_foreach  # noqa: PLC2701 (torch.optim's own choice of kernel, as AdamW makes it)


class AlreadyStepped:
    """Stands in for the inner optimizer during megatron's step_with_ready_grads, whose
    ``optimizer.step()`` already ran in the bucket loop."""

    __slots__ = ("_inner",)

    def __init__(self, inner) -> None:
        self._inner = inner

    def step(self, closure=None) -> None:
        return None

    def __getattr__(self, name):
        return getattr(self._inner, name)


_JSON_SCALARS = (bool, int, float, str, type(None))


def jsonable(value) -> bool:
    """Whether a param group's value can go into the JSON manifest as it is."""
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, _JSON_SCALARS) for v in value)
    return isinstance(value, _JSON_SCALARS)


def one_at_a_time(build, gbuf_ranges, param_gbuf_map, opt_group_ranges, config, result):
    """Run megatron's builder on one param at a time, collecting its five group lists into
    ``result``; yields each 16-bit param's new fp32 main shard as soon as it exists."""
    for g, group_range in enumerate(opt_group_ranges):
        for model_param in group_range["params"]:
            one = [
                {
                    "params": [model_param],
                    "orig_group": {"params": []},
                    "orig_group_idx": group_range.get("orig_group_idx"),
                }
            ]
            built = build(gbuf_ranges, param_gbuf_map, one, config)
            for acc, lists in zip(result, built):
                acc[g].extend(lists[0])
            yield from built[4][0]


def implementation(inner, params) -> tuple[bool, bool]:
    """(fused, foreach) as the inner torch optimizer resolves them for these params."""
    fused, foreach = inner.defaults.get("fused"), inner.defaults.get("foreach")
    if fused is None and foreach is None:
        # torch's own default: foreach on CUDA; fused only when asked for.
        fused, foreach = _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)
    return bool(fused), bool(foreach)


def resident_adam(inner, shard_fp32_groups):
    """A torch Adam of the inner optimizer's kind over the native-fp32 shards, or None."""
    groups = [
        {"params": list(shards), **{k: v for k, v in group.items() if k != "params"}}
        for shards, group in zip(shard_fp32_groups, inner.param_groups)
    ]
    if not any(g["params"] for g in groups):
        return None
    accepted = inspect.signature(type(inner).__init__).parameters
    placeholder = torch.empty(0, device=groups[0]["params"][0].device if groups[0]["params"] else "cpu")
    resident = type(inner)([placeholder], **{k: v for k, v in inner.defaults.items() if k in accepted})
    # The shards are views of the model params (not leaves), which torch's constructor
    # refuses; megatron hands them to its inner optimizer the same way.
    resident.param_groups = groups
    return resident


def sync_hyperparams(inner, resident) -> None:
    """Copy the inner optimizer's hyperparameters into the resident Adam's groups."""
    # LR schedulers write lr and weight_decay into megatron's (the inner) groups.
    if resident is None:
        return
    for source, target in zip(inner.param_groups, resident.param_groups):
        for key, value in source.items():
            if key != "params":
                target[key] = value
