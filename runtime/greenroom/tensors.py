"""Facts about tensors that every layer needs, defined once."""

from __future__ import annotations

import torch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: the local shard of a DTensor (an FSDP2 param, its
    grad and its optimizer state), or ``t`` itself."""
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t
