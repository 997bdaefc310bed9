"""Iteration dirs under ``--save DIR``, the pointer to the newest verified one, and retention.

Layout of a checkpoint root ``DIR`` (Megatron's convention, so its tools find the newest)::

    iter_0000012/                      one checkpoint (``greenroom.train.checkpoint``'s layout)
    iter_0000010/                      an older one, kept as a fallback (``--keep-last``)
    latest_checkpointed_iteration.txt  the newest verified iteration, replaced atomically

Each iteration dir is published whole by ``greenroom.io.publish`` (``iter_N.new`` renamed
into place). Note [a checkpoint is verified before it counts]: a save that hard-links
the live bucket files (``optim.checkpoint.instep``) publishes bytes it did not read: a byte flipped
in a live file after the step wrote it is in the checkpoint too. So a new checkpoint
starts unverified; its linked files are read back against their checksum tables
(``optim.checkpoint.verify_linked``) on a background thread at idle I/O priority, and
only once every rank has passed does the pointer name it (``promote``) and retention
remove what it replaces. A checkpoint that fails is dropped (``drop``) with one line;
the older ones stay. So once one checkpoint is verified, a kill or a flipped byte
anywhere leaves at least one verified checkpoint on disk, and ``--load DIR``
(``candidates``) tries the complete iteration dirs newest first, each verified byte for
byte by the load, falling back past a bad one with one line.

A ``DIR`` holding a single checkpoint (``generation.json`` at its top, the layout of one
replaced-in-place dir) loads as that checkpoint; ``--load DIR/iter_N`` loads that one.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import threading
from collections.abc import Callable

from greenroom.errors import CheckpointError, ConfigError, one_line
from greenroom.faults import kill_point
from greenroom.io import fs, publish
from greenroom.log import get_logger

POINTER = "latest_checkpointed_iteration.txt"
KEEP_LAST = 2
_ITER = re.compile(r"iter_(\d{7})")
log = get_logger(__name__)


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _iteration_of(name: str) -> int | None:
    for suffix in (publish.NEW_SUFFIX, publish.OLD_SUFFIX, ""):
        if name.endswith(suffix):
            match = _ITER.fullmatch(name[: len(name) - len(suffix)] if suffix else name)
            if match:
                return int(match.group(1))
    return None


def _names(root: str) -> list[str]:
    try:
        return os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []


def is_root(path: str) -> bool:
    """Whether ``path`` is a checkpoint root: it has the pointer or an iteration dir (a
    killed save's ``iter_N.new`` included)."""
    return any(name == POINTER or _iteration_of(name) is not None for name in _names(path))


def lock_path(path: str) -> str:
    """The path whose lock guards ``path``: an iteration dir's root (a save's retention
    removes iteration dirs), else ``path`` itself."""
    parent = os.path.dirname(path)
    if _ITER.fullmatch(os.path.basename(path)) and is_root(parent):
        return parent
    return path


def iterations(root: str) -> list[int]:
    """The complete iteration dirs under ``root`` (a generation record), newest first."""
    found = {_iteration_of(n) for n in _names(root) if _ITER.fullmatch(n)}
    return sorted((i for i in found if publish.generation(iteration_dir(root, i)) is not None), reverse=True)


def has_checkpoint(path: str) -> bool:
    """Whether a load of ``path`` finds a checkpoint (``--resume auto``): an iteration dir
    complete or left complete by a killed save, or a single checkpoint at ``path``."""
    path = os.path.realpath(path)
    if publish.has_checkpoint(path):
        return True
    return any(
        os.path.exists(os.path.join(path, n, publish.GENERATION)) for n in _names(path) if _iteration_of(n) is not None
    )


def read_pointer(root: str) -> int | None:
    try:
        with open(os.path.join(root, POINTER), encoding="utf-8") as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def write_pointer(root: str, iteration: int) -> None:
    """Replace the pointer atomically and durably: a reader sees the old or the new number."""
    path = os.path.join(root, POINTER)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    publish.fsync_dir(root)
    kill_point("pointer-written")


def settle(path: str) -> list[str]:
    """Finish or discard what killed saves left: under a root, beside each iteration dir;
    else beside ``path``. Returns what was done, one sentence each."""
    if not is_root(path):
        said = publish.recover(path)
        return [said] if said else []
    said = []
    for it in sorted({_iteration_of(n) for n in _names(path)} - {None}):
        done = publish.recover(iteration_dir(path, it))
        if done:
            said.append(done)
    return said


def candidates(load: str) -> list[str]:
    """The checkpoints ``--load`` tries, in order: a root's complete iteration dirs newest
    first; else ``load`` itself."""
    if not is_root(load):
        return [load]
    found = [iteration_dir(load, i) for i in iterations(load)]
    if not found:
        raise CheckpointError(
            f"--load {load}: no complete iteration dir there (iter_NNNNNNN/ with a valid "
            f"{publish.GENERATION}): nothing to resume from"
        )
    return found


def check_root(save: str) -> None:
    """``--save DIR`` must be nothing, an empty dir, a checkpoint root, or a single
    checkpoint greenroom wrote (its iteration dirs go beside its files)."""
    if not os.path.lexists(save):
        return
    if os.path.islink(save) or not os.path.isdir(save):
        raise ConfigError(f"--save {save} exists and is not a directory; choose another checkpoint dir")
    if not _names(save) or is_root(save) or publish.generation(save) is not None:
        return
    raise ConfigError(
        f"--save {save} holds files that are not greenroom checkpoints (no iter_NNNNNNN/ dirs, no "
        f"{POINTER}); refusing to write there: move them away or choose another dir"
    )


def check_room(root: str, need: int) -> None:
    """A save writes beside every checkpoint it keeps: refused when ``need`` bytes are not
    free there, saying how much it needs."""
    free = fs.free_bytes(root if os.path.isdir(root) else os.path.dirname(root))
    if free < need:
        kept = ", ".join(os.path.basename(iteration_dir(root, i)) for i in iterations(root)) or "none"
        raise CheckpointError(
            f"--save {root}: this checkpoint needs {fs.human_bytes(need)} beside the ones kept "
            f"({kept}), only {fs.human_bytes(free)} is free: free space, lower --keep-last, or "
            "choose another dir; the kept checkpoints are untouched"
        )


def promote(root: str, iteration: int, keep_last: int) -> list[int]:
    """Make the verified ``iteration`` the newest: the pointer names it, then the complete
    iteration dirs older than the ``keep_last`` newest verified go. Dirs newer than
    ``iteration`` (unverified, or skipped by a load) are left to the save that replaces
    them. Returns the iterations removed."""
    write_pointer(root, iteration)
    older = [i for i in iterations(root) if i < iteration]
    removed = older[keep_last - 1 :]
    # An older dir without its generation record is one a killed retention left half deleted.
    removed += [
        i for i in {_iteration_of(n) for n in _names(root) if _ITER.fullmatch(n)} if i < iteration and i not in older
    ]
    for it in removed:
        kill_point("retire")
        publish.discard(iteration_dir(root, it))
    if removed:
        publish.fsync_dir(root)
    return removed


def drop(root: str, iteration: int, why: str) -> None:
    """Remove a checkpoint that failed its verification, saying so and what stays newest."""
    path = iteration_dir(root, iteration)
    publish.discard(path)
    publish.fsync_dir(root)
    left = [i for i in iterations(root)]
    stays = (
        f"{os.path.basename(iteration_dir(root, left[0]))} is the newest checkpoint"
        if left
        else "no checkpoint is left there"
    )
    log.warning(f"--save {root}: dropped {os.path.basename(path)}: {why}; {stays}")


# -- the background read ----------------------------------------------------------------
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}.get(platform.machine())
_IOPRIO_IDLE = 3 << 13  # IOPRIO_PRIO_VALUE(IOPRIO_CLASS_IDLE, 0)


def idle_io_priority() -> None:
    """Put the calling thread's I/O in the idle class: its reads wait for the step's.
    Best effort: a kernel or arch without ioprio_set leaves the priority as it was."""
    if _SYS_IOPRIO_SET is None:
        return
    try:
        # IOPRIO_WHO_PROCESS with id 0: the calling thread.
        ctypes.CDLL(None, use_errno=True).syscall(_SYS_IOPRIO_SET, 1, 0, _IOPRIO_IDLE)
    except (OSError, AttributeError):
        pass


class Verification:
    """``work`` (the read-back of a published checkpoint's linked files) on a daemon
    thread at idle I/O priority; ``wait`` returns None, or the one line it failed with.
    ``work`` None: nothing to read, verified at once."""

    def __init__(self, work: Callable[[], object] | None) -> None:
        self.error: str | None = None
        self._thread = None
        if work is not None:
            self._thread = threading.Thread(target=self._run, args=(work,), name="greenroom-verify", daemon=True)
            self._thread.start()

    def _run(self, work: Callable[[], object]) -> None:
        idle_io_priority()
        try:
            work()
        except BaseException as e:  # any failure leaves the checkpoint unverified: said, never trusted
            self.error = one_line(e)

    def wait(self) -> str | None:
        if self._thread is not None:
            self._thread.join()
        return self.error
