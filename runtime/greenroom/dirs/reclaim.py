"""``greenroom reclaim``: the stale-file janitor.

Removes per-rank dirs (see ``greenroom.dirs.rankdir``) under ROOT whose owner died: a dir is
a candidate only if it carries an ``owner.json``; it is stale only if nobody holds the
flock on its ``.lock`` and it is older than ``--min-age``. The Helm init container and
preStop hook, the janitor DaemonSet and the Slurm templates all run this.

Safety rules, each enforced below:
- a locked dir is never touched, and the lock is held while deleting, so a rank that
  starts meanwhile waits instead of writing into a dir being removed;
- no symlink is followed and ROOT's filesystem is never left (``st_dev`` checks, and a
  dir holding a mount point is refused);
- nothing but a greenroom rank dir is deleted: a dir named ``rank<N>`` whose owner record
  is a JSON object naming that rank and the role and job of the two dirs above it, as
  ``RankDir`` writes it (``is_rank_dir_record``); any other dir that holds an
  ``owner.json`` is kept and reported (the dirs above a reclaimed rank dir or a finished
  aside dir go, up to ROOT, while they hold nothing but the marker of a dir greenroom
  made: ``greenroom.dirs.tree`` Note [made parents]; a user's empty dir stays);
- what is deleted is what was checked: after the first open everything goes through fds
  (the parent's to rename aside and remove by name, the dir's own to lock, check and
  delete its contents), and a rename aside that caught another inode is undone;
- several reclaimers at once are safe: the winner renames the dir aside before deleting,
  losers see it locked or gone;
- a dir whose own rank is removing it is no error: a rank renames its dir aside and
  deletes its lock file last, but an older greenroom's (on a shared node) removes it in
  place by an rmtree that unlinks the lock file at any point and goes on through its fds,
  so a reclaimer may find the dir unlocked and delete beside it; an entry, or the whole
  dir, found gone is what both want;
- nothing leaks: an aside dir (``TRASH_PREFIX``) whose reclaimer, or closing rank
  (``greenroom.dirs.rankdir`` Note [closing aside]), was killed is finished by a later pass
  (its lock file goes last, so one still being deleted is seen locked), and an aside
  symlink is unlinked, never followed;
- a missing or unreadable ROOT, and an age that is not a finite number >= 0, are errors.

This module must not import torch: init containers and prologs run it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import stat
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Callable

from greenroom.dirs.names import LOCK_NAME, OWNER_NAME, TRASH_PREFIX, is_rank_dir_record
from greenroom.dirs.tree import remove_made_dir
from greenroom.errors import ConfigError
from greenroom.faults import kill_point
from greenroom.io import fs

MAX_DEPTH = 6  # <root>/<job>/<role>/rank<NNNNN> is 3; leave room for site layouts above it

# An owner policy sees an unlocked dir's path and owner record and may answer "keep"
# (never touch it, e.g. its pod still exists) or "stale" (reclaim now, skip --min-age);
# None leaves the decision to the age rule.
OwnerPolicy = Callable[[str, dict], "str | None"]


@dataclass
class Decision:
    path: str
    action: str  # "reclaimed", "would-reclaim", "kept", "error"
    reason: str
    bytes: int = 0
    owner: dict = field(default_factory=dict)


@dataclass
class ReclaimReport:
    root: str
    dry_run: bool
    decisions: list[Decision] = field(default_factory=list)

    @property
    def reclaimed(self) -> list[Decision]:
        return [d for d in self.decisions if d.action in ("reclaimed", "would-reclaim")]

    @property
    def errors(self) -> list[Decision]:
        return [d for d in self.decisions if d.action == "error"]

    @property
    def bytes_freed(self) -> int:
        return sum(d.bytes for d in self.reclaimed)

    def as_dict(self) -> dict:
        return {
            "root": self.root,
            "dry_run": self.dry_run,
            "bytes_freed": self.bytes_freed,
            "reclaimed": len(self.reclaimed),
            "errors": len(self.errors),
            "decisions": [asdict(d) for d in self.decisions],
        }


def find_candidates(root: str) -> tuple[list[str], list[str]]:
    """Dirs under ``root`` (same filesystem, no symlinks) that hold an owner record, and
    the aside names (``TRASH_PREFIX``) that reclaim passes left there."""
    root_dev = os.lstat(root).st_dev
    found, trash = [], []

    def walk(path: str, depth: int) -> None:
        try:
            entries = list(os.scandir(path))
        except OSError:
            return  # vanished or unreadable: another reclaimer, or not ours
        if any(e.name == OWNER_NAME and e.is_file(follow_symlinks=False) for e in entries):
            found.append(path)
            return
        if depth == MAX_DEPTH:
            return
        for e in entries:
            if e.name.startswith(TRASH_PREFIX):
                trash.append(e.path)
                continue
            if not e.is_dir(follow_symlinks=False):
                continue
            try:
                if e.stat(follow_symlinks=False).st_dev != root_dev:
                    continue  # a mount point: another filesystem
            except FileNotFoundError:
                continue  # another reclaimer moved it aside just now
            walk(e.path, depth + 1)

    walk(root, 0)
    return sorted(found), sorted(trash)


def _tree_bytes(path: str, dev: int) -> int:
    """Allocated bytes under ``path``; refuses a tree that crosses into another filesystem."""
    total = 0
    for dirpath, dirnames, filenames, dirfd in os.fwalk(path, follow_symlinks=False):
        for name in dirnames + filenames:
            try:
                st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed beside us (see ``_delete_contents``): not counted
            if stat.S_ISDIR(st.st_mode) and st.st_dev != dev:
                raise OSError(errno.EXDEV, f"{os.path.join(dirpath, name)} is a mount point")
            if not stat.S_ISDIR(st.st_mode):
                total += st.st_blocks * 512
    return total


def _read_owner(dir_fd: int) -> dict:
    try:
        fd = os.open(OWNER_NAME, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
        with os.fdopen(fd, encoding="utf-8") as f:
            owner = json.load(f)
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        return {}


def _same_inode(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _delete_contents(dir_fd: int, dev: int, *, keep: str | None = None) -> None:
    """Delete everything in the dir open as ``dir_fd`` through fds relative to it
    (unlinkat/openat), so what goes is the tree that was opened and checked, whatever is
    renamed meanwhile; ``keep`` (the held lock file) is left to the caller. Never follows
    a symlink, never crosses into another filesystem.

    An entry found gone is skipped: a rank removing its own dir by rmtree (see the module
    docstring) may delete beside us. Both want the same tree gone."""
    with os.scandir(dir_fd) as it:
        entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    for name, is_dir in entries:
        if name == keep:
            continue
        try:
            if not is_dir:
                os.unlink(name, dir_fd=dir_fd)
                continue
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                if os.fstat(child).st_dev != dev:
                    raise OSError(errno.EXDEV, f"{name} is a mount point")
                _delete_contents(child, dev)
            finally:
                os.close(child)
            os.rmdir(name, dir_fd=dir_fd)
        except FileNotFoundError:
            continue
        kill_point("reclaim-delete")


def _lock(dir_fd: int) -> tuple[int, bool]:
    """(lock fd or -1, whether a live process holds it)."""
    try:
        lock_fd = os.open(LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return -1, False  # no lock file: nobody can be holding it
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock_fd)
        return -1, True
    return lock_fd, False


def _close_open(*fds: int) -> None:
    """Close the fds a reclaim step opened (-1: never opened)."""
    for fd in fds:
        if fd >= 0:
            os.close(fd)


def _remove_locked(parent_fd: int, name: str, dir_fd: int, dev: int) -> None:
    """Rename the dir open as ``dir_fd`` (whose lock we hold) aside inside ``parent_fd``
    and delete it through its fd. If the name turns out to hold another dir (swapped in
    after our checks), that one is put back untouched."""
    trash = f"{TRASH_PREFIX}{uuid.uuid4().hex[:12]}"
    os.rename(name, trash, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
    moved = os.stat(trash, dir_fd=parent_fd, follow_symlinks=False)
    if not _same_inode(moved, os.fstat(dir_fd)):
        os.rename(trash, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
        raise OSError(errno.ESTALE, "replaced after it was checked; left alone")
    kill_point("reclaim-aside")
    _delete_locked(dir_fd, dev, parent_fd, trash)


def _delete_locked(dir_fd: int, dev: int, parent_fd: int, name: str) -> None:
    """Empty the dir ``name`` of ``parent_fd`` (open as ``dir_fd``, its lock held) and
    remove it. The lock file goes last, so a reclaimer that finds the dir meanwhile sees
    it locked and leaves it to us."""
    _delete_contents(dir_fd, dev, keep=LOCK_NAME)
    try:
        os.unlink(LOCK_NAME, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    try:
        os.rmdir(name, dir_fd=parent_fd)
    except FileNotFoundError:
        pass  # removed beside us (``_delete_contents``)


def inspect_and_reclaim(
    path: str,
    root_dev: int,
    *,
    dry_run: bool,
    min_age: float,
    policy: OwnerPolicy | None = None,
    now: float | None = None,
) -> Decision | None:
    """Decide one candidate dir and (unless ``dry_run``) remove it. None: it vanished.

    Every step after the first open goes through fds: the parent's, to open, rename
    and remove the dir by name; the dir's own, to lock, check and delete its contents."""
    now = time.time() if now is None else now
    try:
        parent_fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        return Decision(path, "error", f"cannot open its parent: {e.strerror}")
    name = os.path.basename(path)
    dir_fd = lock_fd = -1
    try:
        try:
            dir_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            return Decision(path, "error", f"cannot open: {e.strerror}")
        st = os.fstat(dir_fd)
        if st.st_dev != root_dev or os.fstat(parent_fd).st_dev != root_dev:
            return Decision(path, "kept", "on another filesystem")
        lock_fd, held = _lock(dir_fd)
        if held:
            return Decision(path, "kept", "locked by a live process", owner=_read_owner(dir_fd))
        kill_point("reclaim-locked")
        if lock_fd >= 0:
            try:
                if os.stat(LOCK_NAME, dir_fd=dir_fd, follow_symlinks=False).st_ino != os.fstat(lock_fd).st_ino:
                    return None  # replaced under us: another reclaimer or a new owner
            except FileNotFoundError:
                return None
        owner = _read_owner(dir_fd)
        if not is_rank_dir_record(path, owner):
            return Decision(
                path,
                "kept",
                f"not a greenroom rank dir: its {OWNER_NAME} does not name this job, role and rank",
                owner=owner,
            )
        verdict = policy(path, owner) if policy else None
        if verdict == "keep":
            return Decision(path, "kept", "kept by policy (its owner still exists)", owner=owner)
        if verdict != "stale":
            try:
                age = now - os.stat(OWNER_NAME, dir_fd=dir_fd, follow_symlinks=False).st_mtime
            except FileNotFoundError:
                return None
            if age < min_age:
                return Decision(path, "kept", f"younger than --min-age ({age:.0f}s < {min_age:.0f}s)", owner=owner)
        size = _tree_bytes(path, root_dev)
        if dry_run:
            return Decision(path, "would-reclaim", "owner gone", bytes=size, owner=owner)
        # Rename aside first: concurrent reclaimers and a rank starting at this path
        # then never see a half-deleted dir.
        try:
            _remove_locked(parent_fd, name, dir_fd, root_dev)
        except FileNotFoundError:
            return None  # removed beside us: its owner's own close (see ``_delete_contents``)
        return Decision(path, "reclaimed", "owner gone", bytes=size, owner=owner)
    except OSError as e:
        return Decision(path, "error", e.strerror or str(e))
    finally:
        _close_open(lock_fd, dir_fd, parent_fd)


def clean_aside(path: str, root_dev: int, *, dry_run: bool) -> Decision | None:
    """Finish an aside entry an earlier pass or a closing rank left (it was killed
    mid-delete, or refused a symlink that was swapped in). One a live reclaimer or rank is
    still deleting is locked and left to it. A symlink or file is unlinked itself, never
    followed."""
    try:
        parent_fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    name = os.path.basename(path)
    dir_fd = lock_fd = -1
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            if not dry_run:
                os.unlink(name, dir_fd=parent_fd)
            return Decision(path, "would-reclaim" if dry_run else "reclaimed", "left by an interrupted delete")
        dir_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        if os.fstat(dir_fd).st_dev != root_dev:
            return Decision(path, "kept", "on another filesystem")
        lock_fd, held = _lock(dir_fd)
        if held:
            return None  # a reclaimer or a closing rank is deleting it right now
        size = _tree_bytes(path, root_dev)
        if dry_run:
            return Decision(path, "would-reclaim", "left by an interrupted delete", bytes=size)
        _delete_locked(dir_fd, root_dev, parent_fd, name)
        return Decision(path, "reclaimed", "left by an interrupted delete", bytes=size)
    except FileNotFoundError:
        return None  # another reclaimer finished it
    except OSError as e:
        return Decision(path, "error", e.strerror or str(e))
    finally:
        _close_open(lock_fd, dir_fd, parent_fd)


def _remove_empty_parents(path: str, root: str) -> None:
    """Remove the dirs above a reclaimed rank dir or aside dir, up to ROOT, while they hold
    nothing but greenroom's marker: its role and job dirs, and the chart's ``<pod uid>``
    dir. A dir greenroom did not make, or holding anything else, stays."""
    parent = os.path.dirname(path)
    while parent.startswith(root + os.sep) and remove_made_dir(parent):
        parent = os.path.dirname(parent)


# The longest --interval of the janitor's loop: a day (a longer wait overflows the
# platform's timeout, and a node is not swept less often than that).
MAX_INTERVAL_SECONDS = 86400.0


def check_interval(value: float) -> None:
    """``--interval``: more than 0 and at most a day (``nan`` would loop without a pause)."""
    if not 0 < value <= MAX_INTERVAL_SECONDS:
        raise ConfigError(
            f"--interval must be more than 0 and at most {MAX_INTERVAL_SECONDS:g} seconds (a day), got {value}"
        )


def check_seconds(flag: str, value: float) -> None:
    """A duration must be a finite number >= 0 (``nan`` would turn the age check off)."""
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{flag} must be a finite number of seconds >= 0, got {value}")


def reclaim(
    root: str,
    *,
    dry_run: bool = False,
    min_age: float = 0.0,
    policy: OwnerPolicy | None = None,
    missing_ok: bool = False,
) -> ReclaimReport:
    """Reclaim stale per-rank dirs under ``root``; see the module docstring."""
    check_seconds("--min-age", min_age)
    root = os.path.realpath(root)
    report = ReclaimReport(root=root, dry_run=dry_run)
    if not os.path.exists(root):
        if missing_ok:
            return report  # nothing has ever run here
        raise ConfigError(f"reclaim ROOT {root} does not exist (pass --missing-ok where that is expected)")
    if not os.path.isdir(root):
        raise ConfigError(f"reclaim ROOT {root} is not a directory")
    try:
        os.close(os.open(root, os.O_RDONLY | os.O_DIRECTORY))
        os.listdir(root)
    except OSError as e:
        raise ConfigError(f"reclaim ROOT {root} cannot be read ({e.strerror})") from None
    root_dev = os.lstat(root).st_dev
    candidates, trash = find_candidates(root)
    for path in trash:
        decision = clean_aside(path, root_dev, dry_run=dry_run)
        if decision is None:
            continue
        report.decisions.append(decision)
        if decision.action == "reclaimed":
            _remove_empty_parents(path, root)  # a rank (or reclaimer) killed mid-delete left them
    for path in candidates:
        decision = inspect_and_reclaim(path, root_dev, dry_run=dry_run, min_age=min_age, policy=policy)
        if decision is None:
            continue
        report.decisions.append(decision)
        if decision.action == "reclaimed":
            _remove_empty_parents(path, root)
    return report


def print_report(report: ReclaimReport, *, as_json: bool, out=sys.stdout) -> None:
    if as_json:
        print(json.dumps(report.as_dict(), sort_keys=True), file=out)
        return
    for d in report.decisions:
        who = f" (job {d.owner.get('job')}, pid {d.owner.get('pid')} on {d.owner.get('host')})" if d.owner else ""
        size = f" {fs.human_bytes(d.bytes)}" if d.action != "kept" and d.action != "error" else ""
        print(f"{d.action}: {d.path}{size}{who}: {d.reason}", file=out)
    verb = "would free" if report.dry_run else "freed"
    print(
        f"reclaim {report.root}: {len(report.reclaimed)} dir(s), {verb} {fs.human_bytes(report.bytes_freed)}, "
        f"{len(report.errors)} error(s)",
        file=out,
    )
