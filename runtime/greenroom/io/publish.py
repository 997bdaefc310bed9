"""Publishing a checkpoint directory atomically, and finishing or undoing a killed publish.

Both checkpoints (``greenroom train --save`` and ``StreamingAdam.save_checkpoint``) use
this one protocol for a target dir ``P``:

1. ``stage(P)`` first settles whatever an earlier, killed save left (``recover``), then
   gives an empty ``P.new`` to write into.
2. The caller writes its files there.
3. ``publish(P)`` fsyncs every file and dir under ``P.new``, then writes
   ``generation.json`` (this save's id and the id of the checkpoint it replaces) last: a
   dir without it is unfinished. Then ``P.new`` and ``P`` are swapped in one
   ``renameat2(RENAME_EXCHANGE)``, or, where the filesystem lacks it, ``P`` is renamed to
   ``P.old`` and ``P.new`` to ``P``. The replaced checkpoint is then discarded.

So ``P`` is always the previous complete checkpoint until the new one is complete, and
the switch is one rename. A kill anywhere leaves a state ``recover`` can name and settle
from the generation records alone (Note [generation chain]); it runs at the start of
every save and load and reports what it did.

Note [generation chain]: each record holds ``id`` and ``previous`` (the id ``P`` had
when the save started). A complete ``P.new`` whose ``previous`` is ``P``'s id is a
finished save that was not swapped in yet: recovery finishes it. One whose id is
``P``'s ``previous`` is the replaced checkpoint after the swap: it is discarded. With
``P`` missing, a complete ``P.new`` is the newest and is moved in, else a complete
``P.old`` is restored. A dir being discarded loses its record first, so a half-deleted
dir is never mistaken for a complete one.

Small JSON files (the records, the trainer's meta and manifests) carry a CRC-32 of their
own content (``write_checked_json``/``read_checked_json``), so a damaged one is named,
never misread.

Note [one writer per checkpoint dir]: two saves to one ``P`` would each stage, publish
and report success, and ``P`` would hold one of them; a load settling ``P`` while a
save writes ``P.new`` would discard the save's files under it. So every save, and
every settle before a load, runs under ``locked(P)``: an exclusive ``flock`` on
``P.lock`` beside it, whose content names the holder. A load holds it shared, so any
number of readers (every rank of a job reading each other's checkpoints) load at once;
one that finds a killed save to settle upgrades to exclusive first. A second process is refused in
one line naming the holder (never queued: a save that waits would then silently
replace the first), once the lock has stayed taken for ``LOCK_GRACE_S`` (Note [the last
reader's instant]); a wait that short is no queue: it does what the same call half a
second later would do. ``greenroom train`` takes it for ``--save`` at start-up and holds
it for the run, so a second trainer is refused before it trains. The lock file is
removed on release (a process that then wins the lock on the removed inode sees the
path name another one and starts over, as ``greenroom.dirs.rankdir`` does); one a killed
process left is reused by the next save or load. ``held`` is the same lock for one file
with one writer (``greenroom train``'s metrics file).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import shutil
import socket
import threading
import time
import uuid
import zlib

from greenroom.errors import CheckpointError, StorageError
from greenroom.faults import kill_point

GENERATION = "generation.json"
NEW_SUFFIX = ".new"
OLD_SUFFIX = ".old"
LOCK_SUFFIX = ".lock"
_held: dict[str, list[int]] = {}  # checkpoint path -> [lock fd, depth, exclusive]: this process's locks
_depth_guard = threading.Lock()  # depths change on the trainer's thread and its async publish's
LOCK_GRACE_S = 0.5
"""How long a lock found taken is tried again before the taker is refused (Note [the last reader's instant])."""
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


# -- small self-checked JSON files -----------------------------------------------------
def completion_markers(path: str) -> list[str]:
    """The files whose presence means a load of ``path`` finds a complete checkpoint: its
    generation record, or that of a killed save's complete copy beside it (which the
    load's ``recover`` settles). The one rule launchers use to decide on ``--load``."""
    return [os.path.join(path + suffix, GENERATION) for suffix in ("", NEW_SUFFIX, OLD_SUFFIX)]


def has_checkpoint(path: str) -> bool:
    # Resolved as every save and load resolves it: a killed save beside a symlink's target counts.
    return any(os.path.exists(marker) for marker in completion_markers(os.path.realpath(path)))


def _crc_of(payload: dict) -> str:
    return f"{zlib.crc32(json.dumps(payload, sort_keys=True).encode()):08x}"


def write_checked_json(path: str, payload: dict) -> None:
    """Write ``payload`` plus its CRC-32, durably, replacing ``path`` atomically."""
    assert "crc32" not in payload
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({**payload, "crc32": _crc_of(payload)}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_checked_json(path: str, required: dict[str, type]) -> dict:
    """The payload of a ``write_checked_json`` file; one-line ``CheckpointError`` naming
    ``path`` if it is missing, unreadable, not JSON, fails its CRC, or lacks a key of
    ``required`` (name -> type)."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; the checkpoint is incomplete") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror})") from None
    except ValueError:  # UnicodeDecodeError and JSONDecodeError both
        raise CheckpointError(f"{path}: not valid JSON; the file is damaged") from None
    if not isinstance(data, dict) or not isinstance(data.get("crc32"), str):
        raise CheckpointError(f"{path}: no checksum field; not a file this greenroom wrote, or damaged")
    stored = data.pop("crc32")
    if _crc_of(data) != stored:
        raise CheckpointError(
            f"{path}: checksum {_crc_of(data)} does not match its recorded {stored}; the file is damaged"
        )
    for key, kind in required.items():
        if not isinstance(data.get(key), kind) or (kind is int and isinstance(data.get(key), bool)):
            raise CheckpointError(f"{path}: field {key!r} is missing or not {kind.__name__}; the file is damaged")
    return data


def torch_save(obj, path: str) -> None:
    """torch.save through a file we opened, so a write error keeps its errno and names
    the file (torch's own writer turns ENOSPC into an anonymous RuntimeError)."""
    import torch  # only here: the rest of this module is plain file handling

    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
    except (OSError, RuntimeError) as e:
        # torch's zip writer raises its own RuntimeError on the way out, the OSError as its context.
        cause = e
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__context__
        if cause is None:
            raise
        if os.path.lexists(path):
            os.unlink(path)
        raise StorageError(f"{path}: writing the checkpoint failed: {cause.strerror or cause}") from e


# -- durable filesystem steps ----------------------------------------------------------
def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file and dir under ``path``, deepest first (a file before its dir)."""
    for dirpath, _, filenames in os.walk(path, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def exchange(a: str, b: str) -> bool:
    """Swap ``a`` and ``b`` in one ``renameat2(RENAME_EXCHANGE)``; False where the
    kernel or filesystem cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}", b)


def discard(path: str) -> None:
    """Remove a checkpoint dir, its generation record first (see Note [generation chain])."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        try:
            os.unlink(os.path.join(path, GENERATION))
            fsync_dir(path)
        except FileNotFoundError:
            pass
        kill_point("discard")
        shutil.rmtree(path)
    else:
        os.unlink(path)


# -- one writer per checkpoint dir (Note [one writer per checkpoint dir]) ------------------
class LockHeld(Exception):
    """Another process holds a lock file; ``holder`` is what it recorded there (``pid N on HOST``)."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


@contextlib.contextmanager
def locked(path: str, *, reading: bool = False):
    """Hold ``path``'s checkpoint lock for the block (re-entrant within the process):
    exclusive for a save, shared for a load (``reading``), where a read-only location
    (no lock file can be made, so no save can run there either) is read without it.

    The last holder in the process lets go, whichever block it is: the trainer holds the
    lock for the run and an ``--async-save`` publish inside it on its own thread, and a
    publish that a second signal gave up on (``train.saving.Checkpointer.wait_for_publish``) outlives
    the run's block until the process exits. Released by the outer block, the lock left
    that publish writing the checkpoint unguarded."""
    path = os.path.realpath(path)
    held = _held.get(path)
    if held is None:
        fd = _acquire(path, reading)
        if fd < 0:
            yield
            return
        held = _held[path] = [fd, 1, not reading]  # held from here on: no step that could raise between
    else:
        if not reading and not held[2]:
            _upgrade(path, "save there")
        with _depth_guard:
            held[1] += 1
    try:
        yield
    finally:
        with _depth_guard:
            held[1] -= 1
            last = held[1] == 0
            if last:
                del _held[path]
        if last and held[0] >= 0:  # an upgrade may have taken the lock afresh (``_upgrade``)
            _release(path + LOCK_SUFFIX, held[0], exclusive=held[2])


def _acquire(path: str, reading: bool) -> int:
    lock_path = path + LOCK_SUFFIX
    try:
        fd = _take(lock_path, fcntl.LOCK_SH if reading else fcntl.LOCK_EX)
    except LockHeld as e:
        if reading:
            raise CheckpointError(
                f"{path}: another process ({e.holder}) holds {lock_path}: it saves there, and a load now could "
                "read a checkpoint it is replacing: load it once that run is done, or load a copy"
            ) from None
        raise CheckpointError(
            f"{path}: another process ({e.holder}) holds {lock_path}: it is saving there (or resuming from "
            "it) now, and a second save would replace its checkpoint or be replaced by it: wait for it to "
            "finish, or give this run another checkpoint dir"
        ) from None
    except OSError as e:
        if reading and e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return -1
        raise StorageError(f"{lock_path}: cannot create the checkpoint dir's lock file ({e.strerror})") from None
    if not reading:  # readers leave the record alone: it names the last saver or a reader, never garbage
        os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd


def _take(lock_path: str, mode: int) -> int:
    """An fd of ``lock_path`` (created if missing) holding ``flock`` ``mode`` on the inode
    the path names. ``LockHeld`` if another process holds it past ``LOCK_GRACE_S``; the
    ``OSError`` of a file that cannot be opened is the caller's to name."""
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            _flock_within_grace(fd, mode)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise LockHeld(holder) from None
        try:
            same = os.stat(lock_path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # its holder removed it as we opened it: start over


@contextlib.contextmanager
def held(lock_path: str):
    """``lock_path`` locked exclusively for the block, recording this process as its
    holder, and removed after: the checkpoint dir's lock for any one file whose writer
    must be alone (``greenroom train --metrics``). ``LockHeld`` names a live holder; a
    file a killed holder left is taken over (its ``flock`` went with the process)."""
    fd = _take(lock_path, fcntl.LOCK_EX)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    except BaseException:
        _release(lock_path, fd, exclusive=True)
        raise
    try:
        yield
    finally:
        _release(lock_path, fd, exclusive=True)


def _flock_within_grace(fd: int, mode: int) -> None:
    """``flock(fd, mode)`` without queueing behind a holder, tried again for up to
    ``LOCK_GRACE_S``; BlockingIOError if the lock is still taken then.

    Note [the last reader's instant]: a reader that lets go takes the lock exclusively
    for an instant, to learn whether it is the last one (then it removes the file). A
    load or a save that opens the file just then finds it taken, though nobody holds the
    checkpoint (as when two FSDP ranks load each other's checkpoints at once). A real
    holder keeps the lock for a whole load or save, so half a second of retries tells
    the two apart; a file removed meanwhile is caught by the caller's inode check, which
    starts over."""
    deadline = time.monotonic() + LOCK_GRACE_S
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.005)


def _holder(fd: int) -> str:
    lines = os.pread(fd, 256, 0).decode("utf-8", "replace").strip().splitlines()
    return lines[0] if lines else "a process"


def _upgrade(path: str, why: str) -> None:
    """Turn this process's shared hold on ``path`` into an exclusive one, or refuse in
    one line when another reader holds it too."""
    held = _held[path]
    refusal = CheckpointError(
        f"{path}: another process holds {path + LOCK_SUFFIX} while it reads the checkpoint, "
        f"and this process must {why}: retry once that process has loaded it"
    )
    try:
        _flock_within_grace(held[0], fcntl.LOCK_EX)  # another reader may be letting go
    except BlockingIOError:
        raise refusal from None
    # Linux drops the shared hold when a conversion finds the lock taken, so the reader
    # that let go meanwhile may have seen itself as the last and removed the file: a
    # lock won on that inode guards nothing. Then take the lock afresh, as a save does.
    try:
        ours = os.stat(path + LOCK_SUFFIX, follow_symlinks=False).st_ino == os.fstat(held[0]).st_ino
    except FileNotFoundError:
        ours = False
    if not ours:
        os.close(held[0])
        held[0] = -1
        try:
            held[0] = _acquire(path, reading=False)
        except CheckpointError:
            raise refusal from None
    held[2] = True


def _release(lock_path: str, fd: int, *, exclusive: bool) -> None:
    try:
        if not exclusive:
            try:  # the last reader removes the file; one still held by another reader stays
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
        if os.stat(lock_path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
            os.unlink(lock_path)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


# -- the protocol ----------------------------------------------------------------------
def generation(path: str) -> dict | None:
    """The generation record of a complete checkpoint dir, None if unfinished or absent."""
    if not os.path.isdir(os.path.join(path, "")) or not os.path.isfile(os.path.join(path, GENERATION)):
        return None
    try:
        return read_checked_json(os.path.join(path, GENERATION), {"id": str})
    except CheckpointError:
        return None  # damaged: treated as unfinished, never trusted


def recover(path: str) -> str | None:
    """Settle what a killed save left next to ``path``; returns a sentence saying what
    was done (None when there was nothing). See Note [generation chain]."""
    new, old = path + NEW_SUFFIX, path + OLD_SUFFIX
    held = _held.get(path)
    if held is not None and not held[2] and (os.path.lexists(new) or os.path.lexists(old)):
        _upgrade(path, f"settle what a killed save left beside it ({os.path.basename(new)}/.old)")
    said = []
    if os.path.lexists(new):
        gen_new, gen_cur = generation(new), generation(path)
        if gen_new is None:
            discard(new)
            said.append(f"discarded {new}, incomplete: an unfinished save, or the replaced checkpoint half deleted")
        elif gen_cur is not None and gen_new.get("previous") == gen_cur["id"]:
            _swap_in(new, path)
            said.append(f"finished the save in {new}, which was complete but not yet moved into place")
        elif gen_cur is not None and gen_cur.get("previous") == gen_new["id"]:
            discard(new)
            said.append(f"discarded {new}, the checkpoint the last save replaced")
        elif not os.path.lexists(path):
            os.rename(new, path)
            fsync_dir(os.path.dirname(path))
            said.append(f"finished the save in {new}, which was complete but not yet moved into place")
        else:
            raise CheckpointError(f"{new} is a complete checkpoint unrelated to {path}; move one of them away")
    if os.path.lexists(old):
        gen_old = generation(old)
        if gen_old is not None and not os.path.lexists(path):
            os.rename(old, path)
            fsync_dir(os.path.dirname(path))
            said.append(f"restored the previous checkpoint from {old}")
        else:
            discard(old)
            said.append(f"discarded {old}, the checkpoint the last save replaced")
    return "; ".join(said) or None


def stage(path: str) -> tuple[str, str | None]:
    """Settle leftovers and create the empty ``P.new`` to write into; returns it and
    what ``recover`` did."""
    said = recover(path)
    check_replaceable(path)
    if os.path.isdir(path) and not os.listdir(path):
        os.rmdir(path)  # an empty dir made for us: the first save simply renames into place
    new = path + NEW_SUFFIX
    os.makedirs(new, mode=0o700)
    return new, said


def check_replaceable(path: str) -> None:
    """Refuse to replace anything but nothing, an empty dir, or a checkpoint of ours."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        raise CheckpointError(f"{path} exists and is not a directory; choose another checkpoint path")
    if os.listdir(path) and generation(path) is None:
        raise CheckpointError(
            f"{path} exists and is not a checkpoint this greenroom wrote (no valid {GENERATION}); "
            "refusing to replace it: move it away or choose another path"
        )


def publish(path: str) -> None:
    """Make the staged ``P.new`` the checkpoint at ``P`` (see the module docstring)."""
    new = path + NEW_SUFFIX
    current = generation(path)
    fsync_tree(new)
    write_checked_json(
        os.path.join(new, GENERATION), {"id": uuid.uuid4().hex, "previous": current["id"] if current else None}
    )
    fsync_dir(new)
    kill_point("save-staged")
    if not os.path.lexists(path):
        os.rename(new, path)
        fsync_dir(os.path.dirname(path))
        return
    _swap_in(new, path)


def _swap_in(new: str, path: str) -> None:
    if exchange(new, path):
        fsync_dir(os.path.dirname(path))
        kill_point("save-swapped")
        discard(new)  # now the replaced checkpoint
        return
    old = path + OLD_SUFFIX
    os.rename(path, old)
    fsync_dir(os.path.dirname(path))
    kill_point("save-aside")
    os.rename(new, path)
    fsync_dir(os.path.dirname(path))
    kill_point("save-swapped")
    discard(old)
