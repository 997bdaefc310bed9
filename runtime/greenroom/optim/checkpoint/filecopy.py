"""Moving a bucket file's bytes around the I/O engine, and checking them as they move.

``copy_file`` copies a file piece by piece (``copy_file_range``, or a write where the
filesystem cannot): each 64 MiB piece is read once to take its CRC-32 and then copied
from the page cache, so the disk reads each byte once; both files' pages are dropped
piece by piece, so the copy does not grow the page cache. ``FileSums`` sums the pieces
as the I/O engine would (``integrity`` Note [integrity]), to check them against the
live file's table (``checkpoint`` saves) or to write that table (a load of a checkpoint
saved without checksums). ``file_crc32`` is the checkpoint's own CRC-32 of a file.
"""

from __future__ import annotations

import errno
import os
import zlib

import torch

from greenroom.errors import CheckpointError, IntegrityError, StorageError
from greenroom.io.engine import ALIGNMENT, EXTENT, StateFile, align_up, page_sums, pread_all, pwrite_all

PIECE = 64 << 20


# -- the live files' own checksums, summed as a copy reads them -------------------------
class FileSums:
    """The I/O engine's checksums (``integrity`` Note [integrity]) of a bucket file's data,
    summed from its bytes as a copy reads them (``add``), and, with ``expect``, those its
    table records, to ``verify`` them against.

    Note [a save verifies what it copies]: a copy around the engine would take a bit
    flipped in a live file since its last write, checksum it with the checkpoint's
    CRC-32 as if it were good, and publish it over the previous checkpoint, to be refused
    only at the resume. So the copy sums every page it reads as the engine does, and a
    save whose sums differ from the file's table raises before anything is published
    (no extra read: ``verify_against_table`` is the reading form). A state written in
    the step (``optim.checkpoint.instep``) was verified by the step's own reads; a link or a
    clone (``save_load`` Note [a save by links]) reads nothing and is not checked here.
    """

    def __init__(self, file: StateFile, *, expect: bool) -> None:
        self.file = file
        recorded, self.stored = file.recorded(0, file.data_bytes)
        self.expected = recorded if expect else None
        pages = file.data_bytes // ALIGNMENT
        if file.compression is None:
            self.owner = torch.arange(pages, dtype=torch.int64) * ALIGNMENT // EXTENT
        elif self.stored is None:
            raise IntegrityError(
                f"{file.path}: no record of what the frames of {file.label} stored: the file "
                "was not written whole through greenroom's I/O engine, so it cannot be copied"
            )
        else:
            self.owner = torch.full((pages,), -1, dtype=torch.int64)
            for k, (nbytes, shift) in enumerate(self.stored.tolist()):
                first = (k * EXTENT - shift) // ALIGNMENT
                self.owner[first : first + align_up(nbytes) // ALIGNMENT] = k
        self.sums = torch.zeros((file.data_bytes + EXTENT - 1) // EXTENT, dtype=torch.int64)

    def add(self, piece: memoryview, offset: int) -> None:
        """Sum the bytes ``piece`` of the file at ``offset`` (whole pages; the table is skipped)."""
        n = min(len(piece), self.file.data_bytes - offset)
        if n <= 0:
            return
        sums = page_sums(torch.frombuffer(piece[:n], dtype=torch.uint8), offset)
        owner = self.owner[offset // ALIGNMENT : offset // ALIGNMENT + sums.numel()]
        mine = owner >= 0
        self.sums.index_add_(0, owner[mine], sums[mine])

    def verify(self) -> None:
        bad = (self.sums != self.expected).nonzero()
        if bad.numel():
            k = int(bad[0])
            start, end = k * EXTENT, min(self.file.data_bytes, (k + 1) * EXTENT)
            raise IntegrityError(
                f"{self.file.path}: checksum mismatch at offset {start} (bytes [{start}, {end}) of "
                f"{self.file.label}) while saving a checkpoint: the live file is not what greenroom wrote (a "
                "flipped bit, a failing disk or a stray write); nothing was published, the previous checkpoint "
                "stays: restart from it"
            )

    def record(self) -> None:
        """Write the sums into the file's table, as a write through the engine would."""
        self.file.record_sums(0, self.file.data_bytes, self.sums, self.stored)


# -- byte movement ---------------------------------------------------------------------
def copy_file(src: str, dst: str, size: int, *, check=None) -> str:
    """Copy ``size`` bytes of ``src`` over ``dst`` (created or overwritten in place);
    returns the CRC-32 of the bytes as 8 hex digits. Pages are dropped as it goes. An
    OSError (ENOSPC, EIO) becomes a ``StorageError`` naming both files. ``check(piece,
    offset)`` sees every piece of bytes as it is copied (``FileSums.add``)."""
    try:
        return _copy_file(src, dst, size, check)
    except OSError as e:
        raise StorageError(f"copying {src} to {dst} failed: {e.strerror or e}") from e


def _copy_file(src: str, dst: str, size: int, check=None) -> str:
    crc = 0
    buf = bytearray(min(PIECE, max(size, 1)))
    src_fd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dst_fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(dst_fd, size)
            kernel_copy = hasattr(os, "copy_file_range")
            for off in range(0, size, PIECE):
                n = min(PIECE, size - off)
                view = memoryview(buf)[:n]
                pread_all(src_fd, view, off, src, error=CheckpointError)
                if check is not None:
                    check(view, off)
                if kernel_copy:
                    kernel_copy = _copy_range(src_fd, dst_fd, n, off)
                if not kernel_copy:
                    pwrite_all(dst_fd, view, off, dst)
                crc = zlib.crc32(view, crc)
                os.fdatasync(dst_fd)
                for fd in (src_fd, dst_fd):
                    os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)
    return f"{crc:08x}"


def _copy_range(src_fd: int, dst_fd: int, n: int, off: int) -> bool:
    """copy_file_range of one piece; False when the filesystem cannot (then we write)."""
    done = 0
    try:
        while done < n:
            moved = os.copy_file_range(src_fd, dst_fd, n - done, off + done, off + done)
            if moved == 0:
                return False
            done += moved
    except OSError as e:
        if e.errno in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL) and done == 0:
            return False
        raise
    return True


def read_pieces(path: str, size: int, fn) -> None:
    """``fn(piece, offset)`` for the first ``size`` bytes of ``path``, piece by piece, pages dropped."""
    buf = bytearray(min(PIECE, max(size, 1)))
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for off in range(0, size, PIECE):
            view = memoryview(buf)[: min(PIECE, size - off)]
            pread_all(fd, view, off, path, error=CheckpointError)
            fn(view, off)
            os.posix_fadvise(fd, off, len(view), os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def file_crc32(path: str, size: int) -> str:
    """CRC-32 of the first ``size`` bytes of ``path`` (8 hex digits), pages dropped."""
    crc = [0]
    read_pieces(path, size, lambda view, _: crc.__setitem__(0, zlib.crc32(view, crc[0])))
    return f"{crc[0]:08x}"
