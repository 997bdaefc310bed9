"""Making and removing the dirs of a rank dir's tree that greenroom makes, and the files it
writes there.

Note [made parents]: a ``<job>`` or ``<role>`` dir that greenroom makes (its ``mkdir``
succeeds) gets an empty marker file, ``MADE_NAME``, at once; one it finds (a user's own
``ROOT/$SLURM_JOB_ID`` from their prolog) gets none. A remover (``close``, ``greenroom
reclaim``, the Kubernetes janitor's sweep of ``<pod uid>`` trees, whose top dir the
chart's init container marks the same way) takes a dir away only while it holds the
marker and nothing else, so a dir greenroom did not make is never removed, empty or not
(``remove_made_dir``). It unlinks the marker, then ``rmdir``s; a rank that made its dir
in between makes the ``rmdir`` fail, and the marker is put back into the same dir
(through its fd), which is still greenroom's. Trees made before markers existed keep
their empty parents (nothing tells them from a user's). A rank killed between its
``mkdir`` and the marker leaves an unmarked dir: an empty dir leaked, never a user's
dir removed.
"""

from __future__ import annotations

import json
import os
import shutil

from greenroom.dirs.names import DIR_MODE, LOCK_NAME, MADE_NAME


def mkdir_own(path: str) -> bool:
    """Make ``path`` with mode 0700 unless it exists; an existing dir keeps its mode
    (``greenroom.dirs.rankdir`` Note [what greenroom creates]). True when this call made it."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        return False
    os.chmod(path, DIR_MODE)  # our own new dir: the umask must not narrow it further
    return True


def mark_made(dir_fd: int) -> None:
    """Put the marker (Note [made parents]) into the dir open as ``dir_fd``; an empty
    file, so creating it is the whole write."""
    os.close(os.open(MADE_NAME, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd))


def make_rank_path(root: str, path: str) -> None:
    """Make the root (default mode) if missing, then each dir below it up to ``path``
    (mode 0700 and the marker, only those this call creates)."""
    os.makedirs(root, exist_ok=True)
    relative = os.path.relpath(path, root).split(os.sep)
    for i in range(1, len(relative) + 1):
        parent = os.path.join(root, *relative[:i])
        if mkdir_own(parent):
            fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                mark_made(fd)
            finally:
                os.close(fd)


def remove_made_dir(path: str) -> bool:
    """Remove ``path`` if it holds nothing but greenroom's marker (Note [made parents]);
    True when it is gone. ``rmdir`` only: whatever else is in it keeps it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # gone, or not a dir
    try:
        if os.listdir(fd) != [MADE_NAME]:
            return False  # not made by greenroom, or not empty
        try:
            os.unlink(MADE_NAME, dir_fd=fd)
        except FileNotFoundError:
            return False  # another remover took it first and removes the dir
        try:
            os.rmdir(path)
        except OSError:
            # A rank made its dir in it since the listing: still greenroom's dir, so
            # its marker goes back, into the inode it was taken from.
            try:
                mark_made(fd)
            except OSError:
                pass  # removed meanwhile after all
            return False
        return True
    finally:
        os.close(fd)


def write_json_atomic(path: str, payload: dict) -> None:
    """Write ``payload`` so readers see the old file or the new one, never half."""
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def wipe_contents(path: str) -> None:
    """Delete everything in the rank dir ``path`` but its lock file."""
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.name == LOCK_NAME:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
