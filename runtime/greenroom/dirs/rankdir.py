"""Per-rank directories: ``<root>/<job>/<role>/rank<NNNNN>/`` and their lifetime.

A live rank holds an exclusive ``flock`` on ``<dir>/.lock`` for as long as it runs and
records who it is in ``<dir>/owner.json``. That pair is the whole protocol with the
janitor (``greenroom.dirs.reclaim``): a dir with an owner record and a free lock belongs to a
dead process. At start the rank wipes whatever an earlier run left in its own dir; at
exit (return, exception, SIGTERM, SIGINT) it removes the dir.

Note [what greenroom creates]: the root is the user's (a shared 1777 scratch, a dir
another user owns, a mount point). Opening a rank dir never changes its mode, owner or
sticky bit; a root that does not exist is made with the default mode (umask), and only
the dirs greenroom makes below it (``<job>``, ``<role>``, ``rank<N>`` and the rank's
subdirs) get mode 0700, and only dirs it made are ever removed (``greenroom.dirs.tree`` Note [made parents]). A
root this user cannot create a subdir in (not writable, a read-only filesystem, a file)
is refused in one line before anything is created (``root_problem``, which ``doctor``,
``plan`` and the config rules ask too).

Note [claims]: the mechanisms of one process share its rank dir, each in a subdir of its
own that ``claim`` hands out (``optim``, then ``optim-2`` for a second optimizer, ...),
so two owners never write the same files. An owner may also name a dir inside the rank
dir by path (``claim_path``); claims of either kind are compared by real path, and a
claim that is, holds or lies inside a live one is refused (``claim`` skips to the next
name), so no spelling of a path (a symlinked root, ``optim`` named before the RankDir
was handed over) gives one dir two owners. A rank dir opened for a plain path (see
``greenroom.dirs.statedir``) closes itself when its last claim is released.

Note [lock inode]: a reclaimer deletes a dir while holding its lock, so a starting rank
can win a lock on a file that is being unlinked. After ``flock`` succeeds the rank checks
that the path still names the inode it locked and starts over if not.

Note [closing aside]: a closing rank renames its dir aside (``TRASH_PREFIX``, beside it)
while it still holds the lock, then deletes it there, the lock file last, as a reclaimer
does. A successor of the same job, role and rank that starts meanwhile (an elastic
restart) finds no dir at the path and makes its own. Deleted in place, the dir would
have a gap between the lock file's unlink and the ``rmdir``: a successor that opened the
path then would make a fresh lock file and write its files, the ``rmdir`` would fail on
them, and the fallback ``rmtree`` would delete the successor's lock and files while it
ran, leaving the path to a third owner. A rank killed mid-close leaves an aside dir that the next
``greenroom reclaim`` pass finishes (its lock goes last, so a live one is seen locked).

Note [an interrupted close]: SIGTERM (made a SystemExit here) or Ctrl-C that lands in
``close``, raised at once, would stop the delete midway: the rank would end 143 with its
aside dir (and whatever of its files the delete had not reached: at worst the whole
streamed state) and its job/role parents left on disk until the next ``greenroom
reclaim``. A run that
ends by a signal is meant to leave nothing (a scheduler's SIGTERM at a job's end lands
in its close as readily as anywhere). So ``close`` holds the two signals (their handlers
only record them) while it deletes, then puts the handlers back and has each signal that
came do what it would have done then: the rank dir's handler raises SystemExit(128 + N)
or KeyboardInterrupt, after the dir is gone. The delete takes as long as unlinking the
files (well inside Slurm's KillWait and a pod's grace period). ``open`` holds them the
same way from its first ``mkdir`` until its exit hooks are in place: there, at their
default, the two signals would kill the process outright and leave the job/role parents
and a half-made rank dir for reclaim; held, they come after, through the rank dir's
handler, and the open dir is closed on the way out. That hold lasts at most ``LOCK_WAIT_SECONDS`` (the
wait for a reclaimer's lock) beyond the mkdirs. Off the main thread no handler can be
set, and an open or close there runs without the hold. The holding is ``greenroom.dirs.signals``'s, whose
``signals_held`` lends the same hold to the trainer's waits for an ``--async-save``
publish (``greenroom.train.saving.Checkpointer.wait_for_publish``).

Note [vanishing parents]: ``greenroom reclaim`` (and a sibling rank's ``close``) removes
a ``<job>/<role>`` parent that holds only its marker, which can land between a starting
rank's creating that parent and creating its rank dir in it (every multi-pod node under
the chart: init containers and trainers start together). The rank's ``mkdir`` then
fails with ENOENT, and it makes the whole path again (marking what it makes); once its
rank dir exists the parent holds more than the marker and stays.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import threading
import time
import uuid

from greenroom.dirs import signals
from greenroom.dirs.names import (
    DIR_MODE,
    LOCK_NAME,
    OWNER_NAME,
    TRASH_PREFIX,
    boot_id,
    claim_name,
    job_id,
    rank_dir_path,
)
from greenroom.dirs.roots import check_root, memory_problem
from greenroom.dirs.tree import make_rank_path, mkdir_own, remove_made_dir, wipe_contents, write_json_atomic
from greenroom.errors import ConfigError, StorageError
from greenroom.faults import kill_point

LOCK_WAIT_SECONDS = 3.0
PARENT_RETRIES = 100  # Note [vanishing parents]: each retry needs another rmdir to land in the gap

_OPEN: "set[RankDir]" = set()  # the rank dirs this process holds


def held_rank_dir(path: str) -> "RankDir | None":
    """The rank dir this process holds that contains ``path``, if any."""
    path = os.path.realpath(path)
    for rank_dir in _OPEN:
        mine = os.path.realpath(rank_dir.path)
        if path == mine or path.startswith(mine + os.sep):
            return rank_dir
    return None


def _make_rank_dir(root: str, path: str) -> None:
    """Create ``path`` and its parents below ``root``; see Note [vanishing parents]."""
    for _ in range(PARENT_RETRIES):
        try:
            make_rank_path(root, os.path.dirname(path))
            kill_point("rankdir-parents")
            mkdir_own(path)  # the rank dir alone: a parent removed meanwhile is ENOENT here
            return
        except FileNotFoundError:
            continue
    raise StorageError(
        f"{path}: its parent dir was removed {PARENT_RETRIES} times while this rank created it "
        "(a reclaimer in a loop?); stop it and start again"
    )


class RankDir:
    """This rank's own directory, held for the life of the process.

    Args:
        root: ``--offload-train-disk-dir``.
        role: which model of the job (actor, critic, ...), so two never share files.
        rank: this process's global rank.
        job: the job id (default: from the scheduler, see ``job_id``).
        allow_tmpfs: accept a memory-backed root (``--allow-tmpfs``, tests only).

    Use as a context manager, or call ``open()``/``close()``. ``claim(name)`` gives each
    mechanism its own subdirectory (``offload/``, ``optim/``; Note [claims]).
    """

    def __init__(
        self, root: str, *, role: str = "actor", rank: int = 0, job: str | None = None, allow_tmpfs: bool = False
    ) -> None:
        if root is None:  # what a config without the disk target or streaming resolves
            raise ConfigError(
                "RankDir: no root dir: pass --offload-train-disk-dir DIR on node-local NVMe (or set "
                "$GREENROOM_DISK_DIR); only a config with the disk target or streaming resolves one, "
                "so open a RankDir only where config.uses_disk"
            )
        self.root = os.path.abspath(root)
        self.job = job or job_id()
        self.role = role
        self.rank = rank
        self.path = rank_dir_path(self.root, self.job, role, rank)
        self.allow_tmpfs = allow_tmpfs
        self.close_with_last_claim = False
        self._claims: set[str] = set()
        self._claimed_ever: set[str] = set()
        self._lock_fd = -1
        self._previous_handlers: dict[int, object] = {}

    # -- lifetime -----------------------------------------------------------------
    def open(self) -> "RankDir":
        """Make, lock and claim the dir; a SIGTERM or SIGINT meanwhile has its effect once
        the dir is open and its exit hooks are in place (Note [an interrupted close])."""
        if self._lock_fd >= 0:
            return self
        received: list[int] = []
        found = signals.hold(received)
        try:
            try:
                self._open()
            except OSError as e:
                # A full disk (no block left for a dir or the owner record), a read-only or
                # failing one: one line naming the path, never a traceback.
                self.close()
                name = errno.errorcode.get(e.errno, str(e.errno))
                advice = (
                    "free space there or point --offload-train-disk-dir at another disk"
                    if e.errno in (errno.ENOSPC, errno.EDQUOT)
                    else "check --offload-train-disk-dir"
                )
                raise StorageError(
                    f"{e.filename or self.path}: setting up this rank's dir {self.path} failed: "
                    f"{e.strerror} ({name}); {advice}"
                ) from None
        except BaseException:
            signals.put_back(found)
            signals.deliver(found, received)
            raise
        signals.put_back(found)
        self._install_exit_hooks()
        # Through the handlers now in place: the rank dir's own raises SystemExit, and the
        # dir it leaves open is closed on the way out (atexit), as for any later signal.
        signals.deliver({signum: signal.getsignal(signum) for signum in found}, received)
        return self

    def _open(self) -> None:
        self._check_root()
        deadline = time.monotonic() + LOCK_WAIT_SECONDS
        while True:
            try:
                _make_rank_dir(self.root, self.path)
            except PermissionError as e:  # a <job> or <role> dir of another user
                raise ConfigError(
                    f"{self.path}: cannot create {e.filename}: permission denied; "
                    "use a root of your own or another job id"
                ) from None
            try:
                fd = os.open(os.path.join(self.path, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            except FileNotFoundError:
                continue  # a reclaimer renamed the dir away between the two calls
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if any(other.path == self.path for other in _OPEN):
                    raise StorageError(
                        f"{self.path} is held by this process (pid {os.getpid()} on "
                        f"{socket.gethostname()}): close its other owner first, or give this "
                        "one its own dir"
                    ) from None
                if time.monotonic() < deadline:  # a reclaimer holds it only while deleting
                    time.sleep(0.1)
                    continue
                raise StorageError(self._held_message()) from None
            try:
                same = os.stat(os.path.join(self.path, LOCK_NAME)).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # see Note [lock inode]
        self._lock_fd = fd
        _OPEN.add(self)
        wipe_contents(self.path)
        write_json_atomic(os.path.join(self.path, OWNER_NAME), self.owner_record())

    def close(self) -> None:
        """Remove the dir (and the job/role parents greenroom made, once empty) and release
        the lock; a SIGTERM or SIGINT meanwhile has its effect once that is done (Note [an
        interrupted close])."""
        if self._lock_fd < 0:
            return
        received: list[int] = []
        found = signals.hold(received)
        try:
            self._remove_held_dir()
            for parent in (os.path.dirname(self.path), os.path.dirname(os.path.dirname(self.path))):
                if not remove_made_dir(parent):
                    break  # another rank or role of the job is still there, or the dir is the user's
            os.close(self._lock_fd)
            self._lock_fd = -1
            _OPEN.discard(self)
            self._claims.clear()
            self._claimed_ever.clear()
        except BaseException:
            signals.put_back(found)
            signals.deliver(found, received)
            raise
        signals.put_back(found)
        self._restore_handlers()
        signals.deliver(found, received)

    def _remove_held_dir(self) -> None:
        """Delete the dir whose lock this process holds (Note [closing aside])."""
        aside = os.path.join(os.path.dirname(self.path), f"{TRASH_PREFIX}{uuid.uuid4().hex[:12]}")
        try:
            os.rename(self.path, aside)
        except OSError:
            aside = self.path  # not renamable here: delete in place, and never by rmtree
        try:
            wipe_contents(aside)
            kill_point("rankdir-close")
            os.unlink(os.path.join(aside, LOCK_NAME))
            os.rmdir(aside)
        except OSError:
            if aside != self.path:
                shutil.rmtree(aside, ignore_errors=True)  # an aside name is ours alone

    def __enter__(self) -> "RankDir":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def is_open(self) -> bool:
        return self._lock_fd >= 0

    def subdir(self, name: str) -> str:
        assert self.is_open, "open() the rank dir first"
        path = os.path.join(self.path, name)
        mkdir_own(path)
        return path

    def claim(self, name: str) -> str:
        """A new subdir for one owner: ``name``, then ``name-2``, ``name-3``... for the next
        owners in this process (Note [claims]); ``release`` gives it back."""
        if not self.is_open:
            raise ConfigError(f"{self.path}: open() the RankDir before handing it to an optimizer or offloader")
        whole = self._claim_overlapping(self.path)
        if whole is not None and os.path.realpath(whole) == os.path.realpath(self.path):
            raise StorageError(
                f"{self.path} is itself the state dir of another owner in this process (pid "
                f"{os.getpid()} on {socket.gethostname()}): give that owner a dir inside it "
                "(or the RankDir), so each owner has its own"
            )
        n = 1
        while (chosen := claim_name(name, n)) in self._claimed_ever or self._claim_overlapping(
            os.path.join(self.path, chosen)
        ) is not None:
            n += 1
        self._claimed_ever.add(chosen)
        path = self.subdir(chosen)
        self._claims.add(path)
        return path

    def claim_path(self, path: str) -> str:
        """Claim ``path`` itself, a dir inside this rank dir that its caller named."""
        path = os.path.abspath(path)
        other = self._claim_overlapping(path)
        if other is not None:
            where = "is" if os.path.realpath(other) == os.path.realpath(path) else "overlaps"
            raise StorageError(
                f"{path} {where} the state dir of another owner in this process ({other}; pid "
                f"{os.getpid()} on {socket.gethostname()}): give each optimizer its own dir, "
                "or close the other"
            )
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
        self._claims.add(path)
        return path

    def _claim_overlapping(self, path: str) -> str | None:
        """The live claim that is ``path``, holds it or lies inside it, by real path
        (Note [claims]), or None."""
        real = os.path.realpath(path)
        for claimed in self._claims:
            mine = os.path.realpath(claimed)
            if real == mine or real.startswith(mine + os.sep) or mine.startswith(real + os.sep):
                return claimed
        return None

    def release(self, path: str) -> None:
        """The owner of a claimed subdir is done with it; its files go when the rank dir does."""
        self._claims.discard(path)
        self.close_if_unclaimed()

    def close_if_unclaimed(self) -> None:
        """Close a rank dir opened for a plain path that no owner went on to claim."""
        if self.close_with_last_claim and not self._claims:
            self.close()

    # -- internals ----------------------------------------------------------------
    def _check_root(self) -> None:
        check_root(self.root, name="rank dir root")
        problem = None if self.allow_tmpfs else memory_problem(self.root)
        if problem is not None:
            raise ConfigError(f"{self.root} {problem}")

    def owner_record(self) -> dict:
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "boot_id": boot_id(),
            "start_time": time.time(),
            "job": self.job,
            "role": self.role,
            "rank": self.rank,
            "uid": os.getuid(),
        }
        if os.environ.get("GREENROOM_POD_UID"):  # set by the Helm chart (downward API)
            record["pod_uid"] = os.environ["GREENROOM_POD_UID"]
        return record

    def _held_message(self) -> str:
        """Why the lock is taken: by the live run the owner record names, or, when that
        run is gone, by a reclaimer deleting what it left."""
        try:
            with open(os.path.join(self.path, OWNER_NAME), encoding="utf-8") as f:
                owner = json.load(f)
            who = f"pid {owner.get('pid')} on {owner.get('host')}"
        except (OSError, ValueError):
            owner, who = {}, "owner unknown"
        if not isinstance(owner, dict):
            owner, who = {}, "owner unknown"
        if (
            owner.get("host") == socket.gethostname()
            and owner.get("boot_id") == boot_id()
            and isinstance(owner.get("pid"), int)
            and not _alive(owner["pid"])
        ):
            return (
                f"{self.path} is locked, but not by its recorded owner ({who}, which has exited): a "
                "`greenroom reclaim` is deleting what that run left; start again once it is done"
            )
        return (
            f"{self.path} is held by a live process ({who}), another run with the same job id, --role and "
            "rank: give this run its own --role or job id ($GREENROOM_JOB_ID), or stop the other run"
        )

    def _install_exit_hooks(self) -> None:
        atexit.register(self.close)
        if threading.current_thread() is not threading.main_thread():
            return
        # SIGTERM/SIGINT become SystemExit/KeyboardInterrupt so that `with` blocks and
        # finally clauses run; a handler the trainer installed itself is left alone.
        for signum in signals.HELD:
            current = signal.getsignal(signum)
            if current in (signal.SIG_DFL, signal.default_int_handler):
                self._previous_handlers[signum] = current
                signal.signal(signum, signals.raise_exit)

    def _restore_handlers(self) -> None:
        atexit.unregister(self.close)
        if threading.current_thread() is threading.main_thread():
            for signum, handler in self._previous_handlers.items():
                signal.signal(signum, handler)
        self._previous_handlers.clear()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
