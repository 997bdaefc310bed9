"""Errors a user can act on, one hierarchy under ``GreenroomError``. The CLI prints their
one-line message and exits 2.

Configuration mistakes are ``ConfigError``, which is also a ``ValueError`` (what
torch.optim raises for a bad hyperparameter, and what callers of the API are promised);
problems with files on disk (no space, a truncated or foreign file, a checkpoint that
does not match) are ``StorageError``/``CheckpointError``. Anything else is a bug, but
for a collective that failed because another rank went away (``greenroom.ranks.peer_gone``).
"""


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
