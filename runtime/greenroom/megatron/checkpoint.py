"""The streamed state of a megatron-core checkpoint, written beside megatron's own files.

megatron's checkpoint flow (``dist_checkpointing.save`` of the model's and the
optimizer's ``sharded_state_dict``) carries the optimizer's small state: param groups,
the step, the grad scaler, the resident fp32 Adam. The bucket files are not tensors
megatron knows, so ``save_checkpoint`` copies them beside it, synchronously (the next
step would overwrite a bucket still being copied; call it outside async save, after
megatron's save has been scheduled)::

    <checkpoint>/greenroom_optim/opt<K>.rank<NNNNN>/                 greenroom.optim's checkpoint
    <checkpoint>/greenroom_optim/opt<K>.rank<NNNNN>.megatron.json    topology and DP-shard layout

``K`` is the DistributedOptimizer's position in megatron's ChainedOptimizer, ``NNNNN``
the global rank. The directory is a checkpoint of ``greenroom.optim`` (its manifest
records the dtypes, the bucket layout, the world size and rank, a CRC-32 per file, and
its load refuses bytes of another dtype, layout or checksum). The ``.megatron.json``
beside it adds what only megatron knows: TP/PP/DP/EP/CP sizes and ranks, and which slice
of which param each streamed shard is. ``load_checkpoint`` checks that first, so a
changed parallel layout is named, then lets ``greenroom.optim`` verify and copy.

Beside the state dir the files are hard-linked, not read (``greenroom.optim.checkpoint.save_load``
Note [a save by links]); megatron writes each iteration to its own dir and replaces none,
so the older iterations stay while a new one is unverified. ``verify=True`` reads the
linked files back before the save returns; a live bucket file missing or unreadable at
the save is one ``CheckpointError`` naming it.
"""

from __future__ import annotations

import glob
import json
import os

from greenroom.dirs.tree import write_json_atomic
from greenroom.errors import CheckpointError
from greenroom.log import get_logger
from greenroom.megatron.layout import ShardEntry, Topology
from greenroom.optim.checkpoint import save_load as engine_checkpoint

SUBDIR = "greenroom_optim"
SIDECAR_FORMAT = "greenroom-megatron-shards"
SIDECAR_VERSION = 1
log = get_logger(__name__)


def state_dir(checkpoint_dir: str, index: int, rank: int) -> str:
    return os.path.join(checkpoint_dir, SUBDIR, f"opt{index}.rank{rank:05d}")


def sidecar_record(topology: Topology, entries: list[ShardEntry]) -> dict:
    return {
        "format": SIDECAR_FORMAT,
        "version": SIDECAR_VERSION,
        "topology": topology.record(),
        "shards": [e.record() for e in entries],
    }


def verify_sidecar(path: str, saved: dict, topology: Topology, entries: list[ShardEntry]) -> None:
    """Raise ``CheckpointError`` naming how the saved parallel layout differs from this run's."""
    if saved.get("format") != SIDECAR_FORMAT or saved.get("version") != SIDECAR_VERSION:
        raise CheckpointError(
            f"{path}: format {saved.get('format')!r} version {saved.get('version')!r}, this "
            f"greenroom reads {SIDECAR_FORMAT!r} version {SIDECAR_VERSION}"
        )
    mismatch = topology.mismatch(Topology.from_record(saved["topology"]))
    if mismatch:
        raise CheckpointError(f"{path}: {mismatch}")
    ours = [e.record() for e in entries]
    if len(saved["shards"]) != len(ours):
        raise CheckpointError(
            f"{path}: layout differs: {len(saved['shards'])} streamed param shards saved, this "
            f"run has {len(ours)} (a different model or parameter grouping)"
        )
    for a, b in zip(saved["shards"], ours):
        if a != b:
            raise CheckpointError(
                f"{path}: layout differs at {a['name']}: saved shard {a}, this run has {b} "
                "(a different model, parameter grouping or DDP bucketing)"
            )


def locate(checkpoint_dir: str, index: int, rank: int, *, no_load_optim: bool) -> tuple[str, dict] | None:
    """The state dir and sidecar record of optimizer ``index`` on ``rank``; None (with a
    warning) when the checkpoint has no streamed state and ``no_load_optim`` is set."""
    if no_load_optim:
        log.warning(
            f"no_load_optim: not loading the streamed optimizer state from {checkpoint_dir}; starting "
            "a fresh optimizer state (fp32 mains from the current weights, zero moments, step 0)"
        )
        return None
    root = os.path.join(checkpoint_dir, SUBDIR)
    if not os.path.isdir(root):
        raise CheckpointError(
            f"{checkpoint_dir}: no streamed optimizer state ({SUBDIR}/ missing: written before streaming was "
            "enabled, or without greenroom.megatron.save_checkpoint); pass no_load_optim=True (--no-load-optim) "
            "to accept a fresh optimizer state"
        )
    path = state_dir(checkpoint_dir, index, rank)
    sidecar = path + ".megatron.json"
    if not os.path.isfile(sidecar):
        others = sorted(glob.glob(os.path.join(glob.escape(root), "*.megatron.json")))
        written = f"; it was written by {len(others)} optimizer shard(s)" if others else ""
        if others:
            with open(others[0], encoding="utf-8") as f:
                saved = Topology.from_record(json.load(f)["topology"])
            written += f" with tp {saved.tp}, pp {saved.pp}, dp {saved.dp}, ep {saved.ep}, cp {saved.cp}"
        raise CheckpointError(
            f"{checkpoint_dir}: no streamed state for optimizer {index} of rank {rank}{written}; "
            "resume with the same TP/PP/DP/EP/CP sizes, or pass no_load_optim"
        )
    try:
        with open(sidecar, encoding="utf-8") as f:
            return path, json.load(f)
    except ValueError as e:
        raise CheckpointError(f"{sidecar}: not valid JSON ({e}); the checkpoint is damaged") from None


def save_checkpoint(optimizer, checkpoint_dir: str, *, verify: bool = False) -> None:
    """Write the streamed state of every streaming DistributedOptimizer in ``optimizer``
    (a ChainedOptimizer or one) beside megatron's checkpoint in ``checkpoint_dir``;
    ``verify``: read linked files back first (``greenroom.optim.save_checkpoint``)."""
    from greenroom.megatron.block import streaming_members

    rank = _global_rank()
    members = streaming_members(optimizer)
    for member in members:  # optim.poison Note [a failed step poisons]: before anything is written
        member._refuse_if_failed("save_checkpoint()")
    for index, member in enumerate(members):
        path = state_dir(checkpoint_dir, index, rank)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        # The sidecar first: an interrupted save then leaves a sidecar matching this run
        # beside the previous state dir, which greenroom.optim still verifies whole.
        write_json_atomic(path + ".megatron.json", sidecar_record(member.topology, member.shard_entries))
        engine_checkpoint.save_checkpoint(member, path, verify=verify)


def load_checkpoint(optimizer, checkpoint_dir: str, *, no_load_optim: bool = False) -> None:
    """Restore the streamed state saved by ``save_checkpoint``, verified first.

    Call it after megatron has loaded the model weights and the optimizer's state dict.
    With ``no_load_optim`` the streamed state starts fresh from the current weights.
    """
    from greenroom.megatron.block import streaming_members

    rank = _global_rank()
    for index, member in enumerate(streaming_members(optimizer)):
        found = locate(checkpoint_dir, index, rank, no_load_optim=no_load_optim)
        if found is None:
            member.initialize_state()
            continue
        path, saved = found
        verify_sidecar(path + ".megatron.json", saved, member.topology, member.shard_entries)
        engine_checkpoint.load_checkpoint(member, path)
        member._state_replaced()  # every bucket, the resident state and the step count


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
