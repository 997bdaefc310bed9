"""greenroom's logs: one ``greenroom`` logger hierarchy, the rank in every record.

Every module logs through ``get_logger(__name__)`` (a child of ``greenroom``). The logger
stamps each record with the rank of the process that wrote it (``record.rank``: an int,
or None for a process that is not one rank of a job, such as ``greenroom reclaim``), so
eight ranks writing into one Slurm ``.out`` or ``kubectl logs`` stay apart.

As a library greenroom installs no handler (a ``NullHandler`` on ``greenroom``, the
stdlib convention): the application decides where records go. The ``greenroom`` command
calls ``configure()`` once, which writes INFO and above to stderr as
``greenroom[rank 3] WARNING: <message>`` and routes Python warnings (ours and torch's)
to the same lines.

Which of the two a module uses follows the stdlib rule: ``warnings.warn`` when the
caller can change its call to avoid it (a flag that is ignored, tmpfs allowed for a
test), a log record for what happened at run time (a checkpoint settled, a backend
fallen back to, a fresh optimizer state started).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

ROOT = "greenroom"


def current_rank() -> int | None:
    """This process's rank: torch.distributed's once initialised, else the launcher's
    ``RANK`` (torchrun, our sbatch template) or ``SLURM_PROCID`` (srun); None outside a job.

    torch is consulted only if something already imported it: ``greenroom reclaim`` and
    the Slurm renderer import no torch, and logging a line must not change that.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for name in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


class RankFilter(logging.Filter):
    """Puts ``rank`` into every record of the logger it is attached to, at the time of
    logging (the process group may be initialised after the logger was made)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "rank"):
            record.rank = current_rank()
        return True


_RANK = RankFilter()


def get_logger(name: str) -> logging.Logger:
    """The logger of module ``name`` (``__name__``), a child of ``greenroom``."""
    assert name == ROOT or name.startswith(ROOT + "."), name
    logger = logging.getLogger(name)
    logger.addFilter(_RANK)  # a no-op when already there
    return logger


class Formatter(logging.Formatter):
    """``greenroom[rank 3] WARNING: <message>``; ``greenroom WARNING: ...`` without a rank."""

    def format(self, record: logging.LogRecord) -> str:
        # A record from a logger made outside get_logger has no rank yet.
        rank = record.rank if hasattr(record, "rank") else current_rank()
        where = ROOT if rank is None else f"{ROOT}[rank {rank}]"
        return f"{where} {record.levelname}: {record.getMessage()}"


class _StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is at each record, not as it was when the CLI
    started: in-process callers of ``cli.main`` (pytest's capsys, a forked child that
    swapped fd 2) replace it."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    get_logger(ROOT).warning("%s", message)


def configure(level: int = logging.INFO) -> None:
    """What the ``greenroom`` command does once at start: records at ``level`` and above,
    and every Python warning, as one line each on stderr. Calling it again changes nothing."""
    logger = logging.getLogger(ROOT)
    logger.setLevel(level)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(Formatter())
        logger.addHandler(handler)
    warnings.showwarning = _show_warning


logging.getLogger(ROOT).addHandler(logging.NullHandler())
