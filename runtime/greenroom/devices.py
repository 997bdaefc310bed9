"""The device a command runs on, the codec the flags run there, and whether tensors of
a size fit there before the first allocation. torch is imported when these are called,
never at import."""

from __future__ import annotations

from greenroom.config import OffloadConfig, check_host_bytes
from greenroom.errors import ConfigError
from greenroom.io import fs


def resolve_device(wanted: str, command: str | None = None) -> str:
    """``cuda`` or ``cpu`` for a ``--device`` of ``wanted``; ``cuda`` where no CUDA device
    is up is refused in one line (before torch would raise its own multi-line error
    mid-run), prefixed with ``command`` where the CLI's own prefix does not name it."""
    import torch

    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"{f'{command}: ' if command else ''}--device cuda: no CUDA device is available; use --device cpu (or auto)"
        )
    return wanted


def resolve_codec(config: OffloadConfig, device):
    """The ``greenroom.io.compression.ResolvedCodec`` of ``--offload-train-disk-compression``
    on ``device`` with the config's chunk, or None where nothing goes to disk: resolved once
    per run and handed to the offloader, the streaming optimizer and the run's header, so
    all three name the codec that runs. Call it after CUDA is set up (``auto`` loads nvCOMP)."""
    import torch

    from greenroom.io.compression import resolve

    if not config.uses_disk:
        return None
    return resolve(
        config.offload_train_disk_compression, cuda=torch.device(device).type == "cuda", chunk_bytes=config.chunk_bytes
    )


def check_device_bytes(flag: str, value, nbytes: int, device, *, default, counted: str = "") -> None:
    """Tensors of ``nbytes`` (for ``flag value``) must fit on ``device``: a CUDA device's
    free memory, or the host's RAM for ``cpu`` (``check_host_bytes``), checked before
    the first allocation (a CPU allocation past RAM would bring the OOM killer)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        check_host_bytes(flag, value, nbytes, default=default, counted=counted)
        return
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes > free:
        raise ConfigError(
            f"{flag} {value}: that needs {fs.human_bytes(nbytes)} of device memory"
            f"{f' ({counted})' if counted else ''}, {device} has {fs.human_bytes(free)} free; "
            f"use a smaller value{'' if default is None else f' (default {default})'}"
        )
