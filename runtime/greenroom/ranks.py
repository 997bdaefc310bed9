"""Which rank this process is, as the launcher or torch.distributed says, and the line for
a collective that failed because another rank went away.

Below every other layer but ``errors``: the rank dirs, the trainer and the CLI read it.
This module must not import torch (it reads torch.distributed only when the caller did).
"""

from __future__ import annotations

import os
import re
import sys

from greenroom.errors import ConfigError, GreenroomError

MAX_LAUNCHER_NUMBER = 2**31 - 1  # what torch.distributed and NCCL take as a rank or a size


def launcher_number(var: str, default: int, *, minimum: int = 0) -> int:
    """``$var`` as a launcher sets it (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``: torchrun,
    srun, accelerate, the chart), or ``default`` where it is unset. Anything but a whole
    number from ``minimum`` up is refused in one line naming the variable, where ``int()``
    said only "invalid literal" and a negative rank made a dir named ``rank-0001``."""
    value = os.environ.get(var)
    if value is None:
        return default
    if not (value.isascii() and value.isdigit()) or not minimum <= int(value) <= MAX_LAUNCHER_NUMBER:
        raise ConfigError(
            f"${var}={value!r} is not a whole number from {minimum} to {MAX_LAUNCHER_NUMBER}; "
            "the launcher (torchrun, srun, the chart) sets it: fix or unset it"
        )
    return int(value)


def process_rank() -> int:
    """This process's rank: torch.distributed's when it is up, else ``$RANK`` (torchrun,
    accelerate, Slurm launchers set it), else ``$LOCAL_RANK``, else 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for var in ("RANK", "LOCAL_RANK"):
        if os.environ.get(var) is not None:
            return launcher_number(var, 0)
    return 0


# How gloo and NCCL say a collective lost its peer (torch 2.x): a rank that ended (a
# signal, an error of its own, the launcher stopping the job) takes its connections with it.
_PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote process exited",
    "caused by a remote worker crashing",
)
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*")


def peer_gone(error: BaseException) -> str | None:
    """A line for a collective's failure that says another rank went away, in a job of
    several ranks; None for anything else, which keeps its traceback. That rank's own log
    says why it ended (its signal or its error), and the launcher names it: a traceback
    from each of its peers only buries it."""
    if not isinstance(error, RuntimeError) or isinstance(error, GreenroomError):
        return None
    text = str(error)
    if not any(words in text for words in _PEER_GONE):
        return None
    try:
        if launcher_number("WORLD_SIZE", 1) < 2:
            return None
        rank = process_rank()
    except ConfigError:
        return None
    first = _SOURCE_PREFIX.sub("", text.splitlines()[0] if text else "")
    return (
        f"rank {rank}: a collective with the other ranks failed: another rank went away ({first}); "
        "the launcher's log names the rank that ended first, and that rank's log says why"
    )
