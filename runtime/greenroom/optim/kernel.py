"""The update of one bucket: torch's own AdamW functional, nothing re-implemented.

Calling ``torch.optim.adamw.adamw`` with the lists ``torch.optim.AdamW`` would build
makes the arithmetic the same kernels in the same order (``_fused_adamw_`` on CUDA, the
``_foreach_*`` ops on the CPU), so fp32 state gives bit-identical results. Only where the
state tensors come from differs: the flat bucket tensors the store streamed in.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.optim.adamw import adamw
from torch.optim.optimizer import _get_scalar_dtype  # noqa: PLC2701 (the step dtype torch.optim.AdamW uses)

from greenroom.errors import ConfigError

# Group keys of torch.optim.AdamW that the streamed update does not implement, with the
# only value it accepts: anything else is refused by name rather than ignored.
FIXED_GROUP_KEYS = {
    "amsgrad": False,
    "maximize": False,
    "capturable": False,
    "differentiable": False,
    "decoupled_weight_decay": True,
}


def choose_implementation(device: torch.device, *, fused: bool | None, foreach: bool | None) -> tuple[bool, bool]:
    """``(fused, foreach)``: fused on CUDA and foreach elsewhere unless told otherwise."""
    if fused and foreach:
        raise ConfigError("StreamingAdam: fused and foreach cannot both be True")
    if fused is None and foreach is None:
        return device.type == "cuda", device.type != "cuda"
    return bool(fused), bool(foreach)


def new_step(device: torch.device, *, fused: bool) -> torch.Tensor:
    """A param's step counter, placed and typed as ``torch.optim.AdamW`` places it."""
    if fused:
        return torch.zeros((), dtype=_get_scalar_dtype(is_fused=True), device=device)
    return torch.tensor(0.0, dtype=_get_scalar_dtype())


def bucket_adam_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    group: dict,
    fused: bool,
    foreach: bool,
) -> None:
    """One AdamW step (decoupled weight decay) of the given tensors, in place.

    ``params`` are the fp32 tensors updated (a bucket's master views, or fp32 params
    themselves), ``grads`` fp32 grads of the same shapes, ``steps`` the per-param step
    counters (incremented here, as torch does). ``group`` supplies ``lr``, ``betas``,
    ``eps`` and ``weight_decay`` (read each call, so LR schedulers take effect).
    """
    if not params:
        return
    beta1, beta2 = group["betas"]
    adamw(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        [],
        list(steps),
        foreach=foreach,
        capturable=False,
        differentiable=False,
        fused=fused,
        grad_scale=None,
        found_inf=None,
        has_complex=False,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
    )
