"""Facts about the filesystem a path lives on: type, free space, O_DIRECT support.

Used by the config rules (tmpfs refusal), ``greenroom plan`` / ``doctor`` and the I/O
layer's choice between O_DIRECT and buffered I/O.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
from dataclasses import dataclass

# Filesystems that keep data in RAM: a backup there costs the host memory it was
# meant to save.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})


@dataclass(frozen=True, slots=True)
class MountInfo:
    mount_point: str
    fstype: str
    source: str


def human_bytes(n: float) -> str:
    """``4.0 GiB``-style sizes for messages and reports (whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def nearest_existing(path: str) -> str:
    """The path itself, or its closest ancestor that exists (the dir may not exist yet)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return os.path.realpath(path)


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal.
    return field.encode().decode("unicode_escape") if "\\" in field else field


def mount_of(path: str) -> MountInfo:
    """The mount that holds ``path`` (or its nearest existing ancestor)."""
    target = nearest_existing(path)
    best: MountInfo | None = None
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            mount_point = _unescape(fields[4])
            fstype, source = right.split()[:2]
            inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
            # Later lines over-mount earlier ones, so ">=" keeps the visible one.
            if inside and (best is None or len(mount_point) >= len(best.mount_point)):
                best = MountInfo(mount_point, fstype, _unescape(source))
    assert best is not None, "/proc/self/mountinfo has no root mount"
    return best


def is_memory_backed(path: str) -> bool:
    return mount_of(path).fstype in MEMORY_FILESYSTEMS


def free_bytes(path: str) -> int:
    st = os.statvfs(nearest_existing(path))
    return st.f_bavail * st.f_frsize


def supports_o_direct(directory: str) -> bool:
    """Whether files in ``directory`` can be opened with O_DIRECT and written aligned."""
    if not hasattr(os, "O_DIRECT"):
        return False
    fd, probe = tempfile.mkstemp(prefix=".greenroom-odirect-", dir=directory)
    os.close(fd)
    try:
        try:
            fd = os.open(probe, os.O_RDWR | os.O_DIRECT)
        except OSError as e:
            if e.errno == errno.EINVAL:
                return False
            raise
        try:
            buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
            try:
                os.pwrite(fd, buf, 0)
            except OSError as e:
                if e.errno == errno.EINVAL:
                    return False
                raise
            finally:
                buf.close()
        finally:
            os.close(fd)
        return True
    finally:
        os.unlink(probe)


def stored_bytes(root: str) -> int:
    """Bytes the files under ``root`` take on disk (allocated blocks: a preallocated
    file counts in full, a sparse one only where written)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:  # a file replaced while we walked
                pass
    return total
