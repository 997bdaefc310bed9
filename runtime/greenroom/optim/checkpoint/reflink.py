"""Extent clones (reflinks): a checkpoint of the bucket files that moves no data.

On filesystems that share extents between files (XFS with reflink, btrfs),
``ioctl(FICLONE)`` makes a file that shares every block with its source: no byte is read
or written, and a later write to either file gets new blocks (copy on write). A
checkpoint between steps clones each bucket file this way where the checkpoint dir
refuses hard links to it (``hardlink``, which cost nothing either) and the filesystem
can clone, and ``load_checkpoint`` clones back the same way; elsewhere both copy
(``copy_file_range``).

Detection is the clone itself: the first ``FICLONE`` that fails with "not supported"
(ext4, tmpfs, two filesystems) returns False, and the caller copies that file and the
rest. Clones need the room the copy would have taken, only later: the next step's
writes to the live file allocate new blocks. So a clone is only tried when the
filesystem has at least the state's size free (``usable``); otherwise it copies,
and running out of space stays a setup error rather than a failure mid-step.
"""

from __future__ import annotations

import errno
import fcntl
import os

from greenroom.errors import StorageError
from greenroom.io import fs
from greenroom.io.engine import verify_default

FICLONE = 0x40049409  # _IOW(0x94, 9, int), linux/fs.h
_UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM)


def usable(src_dir: str, dst_dir: str, nbytes: int) -> bool:
    """Whether to try cloning ``nbytes`` of files from ``src_dir`` into ``dst_dir``: the
    files carry verified checksum tables (the manifest records the table's CRC-32
    instead of reading the data), both dirs are on one filesystem, and it has room
    for the copy-on-write the clones will take."""
    if not verify_default():
        return False
    try:
        same = os.stat(src_dir).st_dev == os.stat(dst_dir).st_dev
    except OSError:
        return False
    return same and fs.free_bytes(dst_dir) >= nbytes


def clone(src: str, dst: str) -> bool:
    """Make ``dst`` (created, or replaced in place) a clone of ``src``; False where the
    filesystem cannot (then ``dst`` is as it was, or absent if we created it)."""
    src_fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        created = not os.path.exists(dst)
        dst_fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.ioctl(dst_fd, FICLONE, src_fd)
            os.fsync(dst_fd)
        except OSError as e:
            if e.errno in _UNSUPPORTED:
                if created:
                    os.unlink(dst)
                return False
            raise StorageError(f"cloning {src} to {dst} failed: {e.strerror or e}") from e
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)
    return True
