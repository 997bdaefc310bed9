"""Errors a user can act on, one hierarchy under ``GreenroomError``. The CLI prints their
one-line message and exits 2.

Configuration mistakes are ``ConfigError``, which is also a ``ValueError`` (what
torch.optim raises for a bad hyperparameter, and what callers of the API are promised);
problems with files on disk (no space, a truncated or foreign file, a checkpoint that
does not match) are ``StorageError``/``CheckpointError``. Anything else is a bug, but
for a collective that failed because another rank went away (``peer_gone``).
"""

import re


class GreenroomError(RuntimeError):
    """A condition the user must fix; the message says what and how."""


class ConfigError(GreenroomError, ValueError):
    """A flag, argument or setting that cannot work; the message names it and the fix."""


class StorageError(GreenroomError):
    """A state file cannot be created, is too short, or the disk is full."""


class CheckpointError(GreenroomError):
    """A checkpoint does not match the current run or fails its checksums."""


class IntegrityError(StorageError):
    """Bytes read back from a state file are not the bytes written there: its checksum
    does not match (a bit flip, a firmware bug, a stray write). Nothing read is used."""


def one_line(error: BaseException) -> str:
    """``error`` as its type and the first line of its message, for a message of our own
    that names it (``StorageError: ...: write of ... failed``)."""
    text = str(error)
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


# How gloo and NCCL say a collective lost its peer (torch 2.x): a rank that ended (a
# signal, an error of its own, the launcher stopping the job) takes its connections with it.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited",
              "caused by a remote worker crashing")
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
    from greenroom.dirs.statedir import launcher_number, process_rank

    try:
        if launcher_number("WORLD_SIZE", 1) < 2:
            return None
        rank = process_rank()
    except ConfigError:
        return None
    first = _SOURCE_PREFIX.sub("", text.splitlines()[0] if text else "")
    return (f"rank {rank}: a collective with the other ranks failed: another rank went away ({first}); "
            "the launcher's log names the rank that ended first, and that rank's log says why")
