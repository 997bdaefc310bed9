"""``--save`` / ``--load`` for ``greenroom train``: per-rank model and optimizer state.

Layout: ``DIR/meta.json`` (iteration, world size, how the optimizer state was kept) and
``DIR/rank<NNNNN>/`` with ``model.pt`` and either ``optim.pt`` (resident AdamW) or
``optim/`` (StreamingAdam's own checkpoint). Each rank writes into a temporary dir and
renames it; rank 0 writes meta.json last, so a checkpoint without it is incomplete.
Resume is same-topology only, as for the streamed state.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings

import torch

from greenroom.errors import CheckpointError
from greenroom.rankdir import write_json_atomic

META = "meta.json"
FORMAT = 1


def _local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t


def _model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: _local(t.detach()).clone().cpu() for name, t in model.state_dict().items()}


def rank_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank:05d}")


def save(directory: str, *, model, optimizer, streaming: bool, iteration: int, rank: int, world_size: int,
         barrier) -> None:
    final = rank_path(directory, rank)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp, mode=0o700)
    torch.save(_model_state(model), os.path.join(tmp, "model.pt"))
    if streaming:
        optimizer.save_checkpoint(os.path.join(tmp, "optim"))
    else:
        torch.save(optimizer.state_dict(), os.path.join(tmp, "optim.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    barrier()
    if rank == 0:
        write_json_atomic(os.path.join(directory, META), {
            "format": FORMAT, "iteration": iteration, "world_size": world_size, "streaming": streaming})


def load(directory: str, *, model, optimizer, streaming: bool, no_load_optim: bool, rank: int,
         world_size: int) -> int:
    """Restore this rank's state; returns the iteration to continue from."""
    try:
        with open(os.path.join(directory, META), encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"--load {directory}: no {META} (not a greenroom train checkpoint, "
                              "or its save did not finish)") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"--load {directory}: format {meta.get('format')!r}, expected {FORMAT}")
    if meta["world_size"] != world_size:
        raise CheckpointError(f"--load {directory}: saved with {meta['world_size']} ranks, this run has "
                              f"{world_size}; resume is same-topology only")
    path = rank_path(directory, rank)
    state = torch.load(os.path.join(path, "model.pt"), weights_only=True)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            _local(t).copy_(state[name])
    if no_load_optim:
        warnings.warn(f"--no-load-optim: starting a fresh optimizer state instead of the one in {directory}")
        if streaming:
            optimizer.initialize_state()  # its masters were filled from the weights before they loaded
    elif streaming:
        if not os.path.isdir(os.path.join(path, "optim")):
            raise CheckpointError(
                f"--load {directory}: the checkpoint has no streamed optimizer state (saved without "
                "--stream-optimizer-state-to-disk); pass --no-load-optim to accept a fresh optimizer state")
        optimizer.load_checkpoint(os.path.join(path, "optim"))
    else:
        if not os.path.isfile(os.path.join(path, "optim.pt")):
            raise CheckpointError(
                f"--load {directory}: the optimizer state was streamed (saved with "
                "--stream-optimizer-state-to-disk); add that flag to resume it, or pass --no-load-optim")
        optimizer.load_state_dict(torch.load(os.path.join(path, "optim.pt"), weights_only=False))
        # Storages torch.load made are not resizable: own copies let offload free them.
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.clone()
    return int(meta["iteration"])
