"""Actor offload: a sleep/wake pair that moves all of the actor's device memory to host
memory or to per-rank files and brings it back bit-identical.

    offloader = greenroom.actor.build_offloader(config, rank_dir, device=device)
    with offloader.asleep():   # every live tensor of the actor moves; track() is a hint
        rollout()          # has the memory the actor gave back

On CUDA the process must start with ``launch_env(config, rank)`` (torch_memory_saver's
hook); elsewhere, or without the hook, the portable backend runs. See docs/offload.md.
"""

from __future__ import annotations

import torch

from greenroom.actor.launch import (
    OFFLOAD_NAME,
    check_disk_support,
    hook_library,
    hooks_loaded,
    launch_env,
    relaunch_with,
)
from greenroom.actor.offloader import SCOPES, Offloader, PhaseStats, PortableOffloader, Prepared
from greenroom.config import OffloadConfig
from greenroom.dirs.statedir import claim_state_dir
from greenroom.errors import ConfigError
from greenroom.io.compression import ResolvedCodec, resolved
from greenroom.log import get_logger

BACKENDS = ("auto", "tms", "portable")
log = get_logger(__name__)


def build_offloader(
    config: OffloadConfig,
    rank_dir=None,
    *,
    device: torch.device | str = "cpu",
    backend: str = "auto",
    mover: str | None = None,
    scope: str = "all",
    skip_clean: bool | None = None,
    compression: ResolvedCodec | None = None,
) -> Offloader:
    """The offloader these settings call for.

    Args:
        config: the validated flags; ``--offload-train`` off gives a resident no-op.
        rank_dir: for the disk target, where the files go: the open
            ``greenroom.dirs.rankdir.RankDir`` (its ``offload/`` subdir), or a plain path, under
            which this rank's own locked rank dir is made and removed on ``close()``
            (``greenroom.dirs.statedir``).
        device: the actor's device.
        backend: ``tms`` (CUDA, hook preloaded), ``portable``, or ``auto``: tms where the
            hook is loaded on CUDA, portable otherwise.
        mover: for tms, who copies the bytes (``greenroom`` or ``tms``, see
            ``greenroom.actor.tms``); default: what ``launch_env`` set.
        scope: ``all`` (default): every live allocation the backend finds moves;
            ``tracked``: only what ``track()`` named (opt-in, see docs/offload.md).
        skip_clean: disk target: do not rewrite a unit whose bytes the file already
            holds (checked by a device-side fingerprint); default on for CUDA units.
        compression: the codec a run resolved once for ``device`` and the config's chunk
            (``greenroom.io.compression.resolve``); None: resolved here from
            ``config.offload_train_disk_compression``.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"--offload-backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
    device = torch.device(device)
    if not config.offload_train:
        return Offloader(target=config.offload_train_target, device=device)
    codec = None
    if config.offload_to_disk:
        if rank_dir is None:
            raise ConfigError("build_offloader: the disk target needs rank_dir (an open RankDir, or a path)")
        codec = resolved(
            compression or config.offload_train_disk_compression,
            cuda=device.type == "cuda",
            chunk_bytes=config.chunk_bytes,
            what="build_offloader",
        ).codec
    state_dir = claim_state_dir(rank_dir, name=OFFLOAD_NAME, what="build_offloader") if config.offload_to_disk else None
    try:
        offloader = _build(
            config,
            state_dir.path if state_dir else None,
            codec,
            device=device,
            backend=backend,
            mover=mover,
            scope=scope,
            skip_clean=skip_clean,
        )
    except BaseException:
        if state_dir is not None:
            state_dir.release()
        raise
    offloader.state_dir = state_dir
    return offloader


def _build(
    config: OffloadConfig,
    offload_dir: str | None,
    codec,
    *,
    device: torch.device,
    backend: str,
    mover: str | None,
    scope: str,
    skip_clean: bool | None,
) -> Offloader:
    if backend == "auto":
        backend = "tms" if device.type == "cuda" and hooks_loaded() else "portable"
        if device.type == "cuda" and backend == "portable":
            log.warning(
                "torch_memory_saver's hook is not preloaded: using the portable backend "
                "(device addresses change across sleep; start with launch_env to keep them)"
            )
    if backend == "tms":
        from greenroom.actor.tms import TmsOffloader

        return TmsOffloader(
            target=config.offload_train_target,
            device=device,
            offload_dir=offload_dir,
            chunk_bytes=config.chunk_bytes,
            mover=mover,
            scope=scope,
            skip_clean=skip_clean,
            compression=codec,
        )
    return PortableOffloader(
        target=config.offload_train_target,
        device=device,
        offload_dir=offload_dir,
        chunk_bytes=config.chunk_bytes,
        scope=scope,
        skip_clean=skip_clean,
        compression=codec,
    )


__all__ = [
    "BACKENDS",
    "SCOPES",
    "Offloader",
    "PhaseStats",
    "PortableOffloader",
    "Prepared",
    "build_offloader",
    "check_disk_support",
    "hook_library",
    "hooks_loaded",
    "launch_env",
    "relaunch_with",
]
