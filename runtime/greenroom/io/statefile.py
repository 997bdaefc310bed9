"""``StateFile``: a preallocated file of state with explicit-offset I/O (``greenroom.io.engine``'s lower layer).

O_DIRECT where the filesystem takes it; otherwise buffered I/O that fdatasyncs and drops
the written or read pages, so the page cache never grows with the state. Short
transfers are retried, EINTR is retried by Python (PEP 475), and a file of the wrong
length is refused. Where the checksums of its data live: ``integrity`` Note [integrity].

Note [alignment]: O_DIRECT needs the buffer address, the file offset and the length to
be multiples of the logical block size. Everything here works in 4 KiB units: file
sizes and segment offsets are rounded up to ``ALIGNMENT``, staging buffers are carved
at aligned addresses, and a chunk's tail is padded to the next 4 KiB (the padding lands
in the file's own rounding slack, never in a neighbouring segment).

Note [shared inodes]: a bucket file's inode may have more than one name: a checkpoint
written in the step links the new bucket files into its dir (``optim.checkpoint.instep``), a load
links a checkpoint's files in, and a user may keep a ``cp -l`` backup. Bytes written in
place would land in every name, so a file with its checksums in it is never written
while ``fstat`` counts more than one link (the writer, ``optim.store``, gives such a
bucket a new inode and renames it over the live name; this check in ``write`` is the
last line, one ``fstat`` per chunk).

Note [summed records]: a compressed file's table holds each extent's record (its frame's
stored bytes and shift, Note [packed frames] of ``greenroom.io.frames``) beside its sum, and
a read is steered by the record: how many pages to read, from where, and whether the
frame is a header and payload or raw bytes. Range checks and the header catch most bad
records, but not one rewritten to exactly the frame's raw length over pages of zeros
(a fresh file's tail: zeros add nothing to a sum of pages), which would read the header
and payload back as data. So each extent's recorded sum is that of its frame's stored
bytes plus a mix of its record (``integrity.record_mix``), and ``recorded`` takes the
mix back out: a record changed in any way leaves a sum that the bytes it points to do
not match, and every check of the sums (a read's, a checkpoint's) sees it. A table of
this kind marks each record with ``_SUMMED`` in its stored bytes, a bit no record of an
older file has (a frame stores at most 1 MiB): their sums stay as they were and read as
they are, and a mark set or cleared by damage leaves a sum with the mix in it, or taken
out, that matches nothing. The in-memory records of ``checksums="memory"`` are summed the
same way, without a mark (they never outlive the process).
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import os
import threading
import zlib

import torch

from greenroom.errors import ConfigError, IntegrityError, StorageError
from greenroom.io import fs
from greenroom.io.integrity import ALIGNMENT, EXTENT, align_up, engine_owned, extent_sums, record_mix, verify_default

_SUM_BYTES = 8
_STORED_BYTES = 8  # per extent of a compressed file: its frame's stored bytes and shift (``frames``)
_SUMMED = 1 << 30  # in a record's stored bytes: its extent's sum covers the record (Note [summed records])


def aligned_host(nbytes: int) -> torch.Tensor:
    backing = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
    skew = (-backing.data_ptr()) % ALIGNMENT
    return backing[skew : skew + nbytes]


def _os_error(path: str, label: str, op: str, nbytes: int, offset: int, e: OSError) -> StorageError:
    """One line naming the file, the operation and what to do about it."""
    name = errno.errorcode.get(e.errno, str(e.errno))
    advice = {
        errno.ENOSPC: "the disk is full: free space or point --offload-train-disk-dir at a larger disk",
        errno.EDQUOT: "the disk quota is exhausted: free space or raise the quota",
        errno.EIO: "the device reported an I/O error: check the disk (dmesg); the state in this file is lost",
        errno.EROFS: "the filesystem went read-only (often after an I/O error): check the disk (dmesg)",
    }
    return StorageError(
        f"{path}: {op} of {nbytes} bytes at offset {offset} of {label} failed: "
        f"{e.strerror or e} ({name}); " + advice.get(e.errno, "check the disk and the dir")
    )


def pwrite_all(fd: int, buf: memoryview, offset: int, path: str) -> int:
    """Write all of ``buf`` at ``offset``, retrying short writes; returns ``len(buf)``."""
    done = 0
    while done < len(buf):
        n = os.pwrite(fd, buf[done:], offset + done)
        if n == 0:
            raise StorageError(f"{path}: write returned 0 bytes at offset {offset + done}")
        done += n
    return done


def pread_all(fd: int, buf: memoryview, offset: int, path: str, *, error: type = StorageError) -> int:
    """Fill all of ``buf`` from ``offset``, retrying short reads; a file that ends
    first raises ``error`` (the caller's kind: a state file or a checkpoint)."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise error(
                f"{path}: file ended at offset {offset + done}, expected {len(buf) - done} more bytes (truncated?)"
            )
        done += n
    return done


class StateFile:
    """A fixed-size file of state with positional I/O.

    Args:
        path: the file. Created with mode 0600 when ``create`` is true.
        size: logical size in bytes; the file occupies ``align_up(size)``.
        create: preallocate (``posix_fallocate``) the file, reusing it in place if it
            exists. Otherwise open an existing file and verify its length.
        direct: force O_DIRECT on (True) or off (False); None tries it and falls back.
        label: what the file holds, for error messages ("bucket 3 of the optimizer state").
        checksums: where ``TransferEngine`` keeps the file's checksums (Note [integrity]):
            "memory" (per transfer range, while the file is open) or "file" (a table after
            the data, ``table_bytes(size)`` long; transfers must then cover the whole data).
        compression: the frame codec of ``greenroom.io.compression`` that transfers of this
            file run (None: bytes stored as they are). The file keeps its raw size; what
            and where each frame stored is recorded with the checksums (Note [packed frames]).

    Running out of space is a ``StorageError`` here, at setup, never a SIGBUS or
    garbage later; a partially created file is removed.
    """

    def __init__(
        self,
        path: str,
        size: int,
        *,
        create: bool = True,
        direct: bool | None = None,
        label: str = "a state file",
        checksums: str = "memory",
        compression=None,
    ) -> None:
        assert checksums in ("memory", "file")
        self.path = path
        self.size = size
        self.label = label
        self.compression = compression
        self.data_bytes = align_up(size)
        self.table_offset = self.data_bytes if checksums == "file" else None
        self.allocated = self.file_bytes(size, checksums=checksums, compressed=compression is not None)
        self._sums: dict[tuple[int, int], torch.Tensor] = {}
        self._stored: dict[tuple[int, int], torch.Tensor] = {}
        self.disk_bytes_written = 0
        self.disk_bytes_read = 0
        """Bytes written to and read from the file since it was opened, its tables
        included: below the tensors' bytes where frames were compressed."""
        self._count_lock = threading.Lock()
        self._sums_lock = threading.Lock()
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        existed = os.path.exists(path)
        self.created = create and not existed
        if create:
            flags |= os.O_CREAT
        elif not existed:
            raise StorageError(f"{path}: state file is missing")
        self.direct = False
        fd = None
        if direct is not False and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL or direct:
                    raise
        if fd is None:
            fd = os.open(path, flags, 0o600)
        self.fd = fd
        try:
            if create:
                self._preallocate(existed)
            else:
                actual = os.fstat(fd).st_size
                if actual != self.allocated:
                    raise StorageError(
                        f"{path}: file is {actual} bytes, expected {self.allocated}: truncated, "
                        "or written by a different layout; it cannot be read"
                    )
        except BaseException:
            os.close(fd)
            self.fd = -1
            if self.created and os.path.exists(path):
                os.unlink(path)
            raise

    @staticmethod
    def table_bytes(size: int, *, compressed: bool = False) -> int:
        """Bytes of the in-file table of a file of ``size`` data bytes: a checksum per
        extent, and for a compressed file what and where each extent's frame stored."""
        extents = (align_up(size) + EXTENT - 1) // EXTENT
        return align_up(extents * (_SUM_BYTES + (_STORED_BYTES if compressed else 0)))

    @classmethod
    def file_bytes(cls, size: int, *, checksums: str = "memory", compressed: bool = False) -> int:
        """What a file of ``size`` data bytes occupies on disk."""
        return align_up(size) + (cls.table_bytes(size, compressed=compressed) if checksums == "file" else 0)

    def _preallocate(self, existed: bool) -> None:
        try:
            os.posix_fallocate(self.fd, 0, self.allocated)
            if os.fstat(self.fd).st_size != self.allocated:
                os.ftruncate(self.fd, self.allocated)
        except OSError as e:
            if not existed and os.path.exists(self.path):
                os.unlink(self.path)
                self.created = False
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageError(
                    f"{self.path}: not enough space to preallocate {fs.human_bytes(self.allocated)} "
                    f"({fs.human_bytes(fs.free_bytes(os.path.dirname(self.path)))} free on "
                    f"{fs.mount_of(self.path).mount_point}); free space or point "
                    "--offload-train-disk-dir at a larger disk"
                ) from None
            raise _os_error(self.path, self.label, "preallocation", self.allocated, 0, e) from None

    def grow(self, size: int) -> None:
        """Extend the file in place to ``size`` data bytes: what it holds, and the
        checksums recorded for it, stay valid (the actor's offload file grows when the
        actor allocates more, and its clean slots must still verify on wake)."""
        if self.table_offset is not None:
            raise ConfigError(f"{self.path}: a file with its checksum table in it cannot grow")
        if align_up(size) <= self.data_bytes:
            return
        self.size, self.data_bytes = size, align_up(size)
        self.allocated = self.data_bytes
        self._preallocate(existed=True)

    def write_zeros(self, start: int, end: int, *, buffer_bytes: int, threads: int = 4) -> int:
        """Write zeros over bytes [start, end) (4 KiB aligned) from ``threads`` threads
        sharing one zeroed buffer of at most ``buffer_bytes``, then make them durable;
        returns the bytes written.

        Note [backed blocks]: the first write to a block the file was just given costs
        more than every later write to it (on the CPU machine's ext4 virtio disk, 2 GiB
        of O_DIRECT writes took 0.99-1.27 s into a fresh ``posix_fallocate`` and 0.63-0.76
        s over the same blocks once written; the same blocks made unwritten again with
        ``FALLOC_FL_ZERO_RANGE`` took the overwrite's time, so the cost is below the
        filesystem, the disk backing the block on first touch, not ext4's conversion of
        unwritten extents). Zeros written once outside a timed phase take that cost
        there (``DiskMover.prepare``)."""
        if start % ALIGNMENT or end % ALIGNMENT:
            raise ConfigError(f"{self.path}: zeros need {ALIGNMENT}-byte aligned bounds, got [{start}, {end})")
        if end <= start:
            return 0
        each = min(max(ALIGNMENT, buffer_bytes // ALIGNMENT * ALIGNMENT), end - start)
        zeros = aligned_host(each)
        zeros.zero_()
        view = memoryview(zeros.numpy())
        offsets = range(start, end, each)

        def fill(first: int) -> None:
            for offset in offsets[first::threads]:
                self.write(view[: min(each, end - offset)], offset)

        with cf.ThreadPoolExecutor(threads, thread_name_prefix="greenroom-zeros") as pool:
            for done in [pool.submit(fill, i) for i in range(min(threads, len(offsets)))]:
                done.result()
        self.sync()
        return end - start

    # -- blocking I/O -------------------------------------------------------------
    def write(self, buf: memoryview, file_offset: int) -> int:
        """Write all of ``buf`` at ``file_offset``; returns the bytes written. A file with
        its checksums in it is refused while another name links its inode (Note [shared
        inodes])."""
        self._check_range(len(buf), file_offset)
        try:
            if self.table_offset is not None and os.fstat(self.fd).st_nlink > 1:
                raise StorageError(
                    f"{self.path}: refusing to write {self.label} in place: its inode has "
                    f"{os.fstat(self.fd).st_nlink} links (a checkpoint or a hard-linked backup "
                    "shares it); greenroom writes such a bucket to a new file instead, so this is "
                    "a bug: report it"
                )
            done = pwrite_all(self.fd, buf, file_offset, self.path)
            with self._count_lock:
                self.disk_bytes_written += done
            if not self.direct:
                # Push the pages out and drop them so the page cache does not hold the state.
                os.fdatasync(self.fd)
                os.posix_fadvise(self.fd, file_offset, done, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise _os_error(self.path, self.label, "write", len(buf), file_offset, e) from None
        return done

    def read(self, buf: memoryview, file_offset: int) -> int:
        """Fill all of ``buf`` from ``file_offset``; returns the bytes read."""
        self._check_range(len(buf), file_offset)
        try:
            done = pread_all(self.fd, buf, file_offset, self.path)
            with self._count_lock:
                self.disk_bytes_read += done
            if not self.direct:
                os.posix_fadvise(self.fd, file_offset, done, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise _os_error(self.path, self.label, "read", len(buf), file_offset, e) from None
        return done

    # -- checksums (Note [integrity]) and stored frame sizes (compression) -----------
    def record_sums(
        self, offset: int, nbytes: int, sums: torch.Tensor | None, stored: torch.Tensor | None = None
    ) -> None:
        """Keep the extent sums of the range just written (``nbytes`` aligned), and for a
        compressed file each extent's frame's stored bytes and shift (Note [packed frames]),
        summed with them (Note [summed records])."""
        if sums is not None and stored is not None:
            sums = sums + record_mix(stored)
        if self.table_offset is None:
            with self._sums_lock:
                end = offset + nbytes
                # A range written differently before (another layout) no longer holds.
                for records in (self._sums, self._stored):
                    for key in [k for k in records if k[0] < end and offset < k[0] + k[1]]:
                        del records[key]
                if sums is not None:
                    self._sums[(offset, nbytes)] = engine_owned(sums)
                if stored is not None:
                    self._stored[(offset, nbytes)] = engine_owned(stored)
            return
        assert offset == 0 and nbytes == self.data_bytes, "a file with its checksums in it is written whole"
        extents = (nbytes + EXTENT - 1) // EXTENT
        table = aligned_host(self.table_bytes(self.size, compressed=self.compression is not None))
        table.zero_()
        if sums is not None:
            table[: extents * _SUM_BYTES].view(torch.int64).copy_(sums)
        if stored is not None:
            records = table[extents * _SUM_BYTES : extents * (_SUM_BYTES + _STORED_BYTES)].view(torch.int32).view(-1, 2)
            records.copy_(stored)
            if sums is not None:
                records[:, 0] |= _SUMMED
        self.write(memoryview(table.numpy()), self.table_offset)
        # What a checkpoint's manifest records of a file it did not read (optim.checkpoint.instep).
        self.table_crc32 = f"{zlib.crc32(memoryview(table.numpy())):08x}"

    def _table(self, offset: int, nbytes: int) -> tuple[torch.Tensor, int]:
        assert offset == 0 and nbytes == self.data_bytes, "a file with its checksums in it is read whole"
        table = aligned_host(self.table_bytes(self.size, compressed=self.compression is not None))
        self.read(memoryview(table.numpy()), self.table_offset)
        return table, (nbytes + EXTENT - 1) // EXTENT

    def recorded(self, offset: int, nbytes: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What was recorded when the range was written: its extent sums, and for a
        compressed file each frame's stored bytes and shift (None: nothing recorded since
        the file was opened). One read of the table of a file that holds it."""
        if self.table_offset is None:
            with self._sums_lock:
                sums, stored = self._sums.get((offset, nbytes)), self._stored.get((offset, nbytes))
            if sums is not None and stored is not None:
                sums = sums - record_mix(stored)
            return sums, stored
        table, extents = self._table(offset, nbytes)
        sums = table[: extents * _SUM_BYTES].view(torch.int64).clone()
        stored = None
        if self.compression is not None:
            stored = table[extents * _SUM_BYTES : extents * (_SUM_BYTES + _STORED_BYTES)].view(torch.int32).view(-1, 2)
            summed = (stored[:, 0] & _SUMMED) != 0
            stored[:, 0] &= ~_SUMMED
            sums -= torch.where(summed, record_mix(stored), 0)
            stored = stored.clone() if bool((stored[:, 0] > 0).all()) else None
        return sums, stored

    def _check_range(self, length: int, file_offset: int) -> None:
        # Errors, not asserts: a caller's bad range must fail under ``python -O`` too.
        if file_offset < 0 or file_offset + length > self.allocated:
            raise ConfigError(
                f"{self.path}: I/O [{file_offset}, {file_offset + length}) outside the file's {self.allocated} bytes"
            )
        if self.direct and (file_offset % ALIGNMENT or length % ALIGNMENT):
            raise ConfigError(
                f"{self.path}: O_DIRECT I/O needs {ALIGNMENT}-byte aligned offsets and lengths, got "
                f"[{file_offset}, {file_offset + length}) (see Note [alignment])"
            )

    def sync(self) -> None:
        """Make everything written durable and drop the file's cached pages."""
        try:
            os.fdatasync(self.fd)
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise _os_error(self.path, self.label, "sync", self.allocated, 0, e) from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "StateFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)


def verify_mapped(file: StateFile, data: torch.Tensor) -> None:
    """Check bytes of ``file`` that were read around the engine (a memory map of its
    data, from offset 0) against the checksums recorded for them; a no-op when
    verification is off."""
    if verify_default():
        check_sums(file, 0, data.numel(), extent_sums(data, 0))


def check_sums(
    file: StateFile, offset: int, nbytes: int, sums: torch.Tensor, expected: torch.Tensor | None = None
) -> None:
    """Raise ``IntegrityError`` (one line: the file, the offset, what it holds) unless
    ``sums`` are the checksums recorded for bytes [offset, offset + nbytes) of ``file``
    (``expected``, when the caller already fetched them)."""
    if expected is None:
        expected = file.recorded(offset, nbytes)[0]
    if expected is None:
        raise IntegrityError(
            f"{file.path}: no checksum for bytes [{offset}, {offset + nbytes}) of {file.label}: "
            "they were not written through greenroom's I/O engine since the file was opened, "
            "so they cannot be verified"
        )
    bad = (sums != expected).nonzero()
    if bad.numel():
        k = int(bad[0]) + offset // EXTENT
        start, end = max(offset, k * EXTENT), min(offset + nbytes, (k + 1) * EXTENT)
        raise IntegrityError(
            f"{file.path}: checksum mismatch at offset {start} (bytes [{start}, {end}) of {file.label}): what "
            "was read back is not what greenroom wrote (a flipped bit, a failing disk or a stray write); "
            "stopped before using it: restart from the last checkpoint"
        )
