"""The root a rank dir tree goes under: refused in one line when this user cannot make a
dir in it (``root_problem``, which ``doctor``, ``plan`` and the config rules ask too) or
when it is memory-backed (``memory_problem``); never changed (``greenroom.dirs.rankdir``
Note [what greenroom creates]).
"""

from __future__ import annotations

import errno
import os
import uuid

from greenroom.dirs.names import DIR_MODE
from greenroom.errors import ConfigError
from greenroom.io import fs


def memory_problem(root: str) -> str | None:
    """Why ``root`` defeats the purpose of a disk dir (it is on a memory-backed
    filesystem), or None; the caller names the path first."""
    if not fs.is_memory_backed(root):
        return None
    mount = fs.mount_of(root)
    return (
        f"is on {mount.fstype} ({mount.mount_point}), which keeps the data in RAM and defeats the purpose; "
        "point it at node-local NVMe"
    )


def root_problem(root: str) -> str | None:
    """Why this user can make no rank dir under ``root``, or None when it can.

    A root that does not exist yet must be creatable in its nearest existing parent.
    Tried with a probe dir (made and removed at once), not read from mode bits: those say
    nothing for root, ACLs, /proc or a read-only mount.
    """
    root = os.path.abspath(root)
    existing = fs.nearest_existing(root)
    own = existing == os.path.realpath(root)
    if not os.path.isdir(existing):
        return "is a file, not a directory" if own else f"cannot be made: {existing} is a file, not a directory"
    probe = os.path.join(existing, f".greenroom-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(probe, DIR_MODE)
    except OSError as e:
        reason = "read-only filesystem" if e.errno == errno.EROFS else e.strerror
        if own:
            return f"is not writable by uid {os.geteuid()}: it takes no new directory ({reason})"
        return f"cannot be made by uid {os.geteuid()}: {existing} takes no new directory ({reason})"
    os.rmdir(probe)
    return None


def check_root(root: str, *, name: str) -> None:
    """``root_problem`` as a ``ConfigError`` naming the flag or argument ``name``."""
    problem = root_problem(root)
    if problem is not None:
        raise ConfigError(
            f"{name} {os.path.abspath(root)} {problem}; point it at a dir on node-local NVMe that you can write"
        )


def check_existing_root(root: str, *, name: str) -> None:
    """``check_root`` for a root that must exist already: a bench's or ``doctor``'s, whose
    rank dir would otherwise make it (and its parents) and leave it behind."""
    if not os.path.isdir(root):
        raise ConfigError(f"{name} {root} is not a directory (create it on node-local NVMe first)")
    check_root(root, name=name)
