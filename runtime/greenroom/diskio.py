"""The one disk I/O engine that actor offload and optimizer streaming share.

Two layers, in the spirit of kvikio's ``CuFile``:

``StateFile``
    A preallocated file with explicit-offset ``read``/``write`` (blocking) and
    ``pread``/``pwrite`` (futures). O_DIRECT where the filesystem takes it; otherwise
    buffered I/O that fdatasyncs and drops the written or read pages, so the page cache
    never grows with the state. Short transfers are retried, EINTR is retried by Python
    (PEP 475), and a file of the wrong length is refused.

``TransferEngine``
    Moves whole tensors (host or CUDA) to and from ``StateFile`` ranges through a fixed
    set of aligned staging buffers whose total is the chunk size (pinned when CUDA is
    up). A driver thread splits each transfer into chunks; ``depth`` worker threads do
    the disk I/O, so reads run ahead and writes run behind while the caller computes.

Every transfer is checksummed on its way through the staging buffers and verified
when read back (Note [integrity]); every error of any engine thread reaches the caller
of ``wait``/``drain``/``close`` (Note [failing fast]).

Note [alignment]: O_DIRECT needs the buffer address, the file offset and the length to
be multiples of the logical block size. Everything here works in 4 KiB units: file
sizes and segment offsets are rounded up to ``ALIGNMENT``, staging buffers are carved
at aligned addresses, and a chunk's tail is padded to the next 4 KiB (the padding lands
in the file's own rounding slack, never in a neighbouring segment).

Note [integrity]: a disk that flips a bit, a firmware bug or a stray write must never
reach training. Each transfer's bytes are hashed per 1 MiB extent of the file (absolute
offsets) as they pass through the host staging buffer, in the I/O worker thread that
moves them, and the sums are checked when the same range is read back; a mismatch
raises ``IntegrityError`` naming the file, the offset and the state it holds, from the
read's ``wait()``, so the caller never decodes the bytes. The hash is linear: the
64-bit wrapping sum of every 8-byte word times an odd multiplier that depends on the
word's position (an odd lane constant times an odd page factor). Any single flipped
bit changes it by +-2^b times an odd number, never 0 mod 2^64, so it is always caught,
and a page written or read at the wrong place is caught too (its factor differs). Being
linear, an extent's sum can be put together from the pieces of any chunking, so it
does not depend on the staging size. It runs as one int64 mat-vec per chunk (no
temporary as large as the chunk; a multiply-then-sum ran 5-10x slower): 9-12 GB/s on
one idle core of the CI machine (3-7 with other jobs on its 2 cores), against ~2 GB/s
disks; each worker hashes while the other workers' I/O keeps the disk busy, and a read
chunk is hashed while its DMA to the device runs. Hashing on
the host rather than on the GPU: the staging buffer is where the bytes leave for, and
arrive from, the disk (so that is what is verified), it is aligned and padded (the
device tensor is neither at its tail), the same code serves CPU and CUDA tensors, and
CUDA has no int64 mat-vec. Where the sums live: in memory per open file, keyed by the
transfer's range (the actor's offload file: it is rewritten every sleep and never
copied), or in a table at the end of the file itself (``checksums="file"``, the
optimizer's bucket files: the checkpoint copies the table with the bytes, so a
loaded checkpoint is verified on its first read like any other state). The files are
wiped at start, so a sum never outlives the process that wrote it unless the file
was copied with it. ``GREENROOM_VERIFY=0`` (or ``TransferEngine(verify=False)``) skips
hashing altogether; it exists to measure the cost, and state written that way cannot
be read back with verification on.

Note [packed frames]: a compressed file (``greenroom.compression``) is cut into frames,
one per ``EXTENT``, and a chunk's frames are stored back to back from the chunk's own
place, each at a page boundary: a chunk moves in one I/O of about its stored size,
whatever each frame shrank to (stored at their own places, 1 MiB frames went out as
~0.9 MB I/Os and ran slower than the raw chunk). Each frame's record holds its stored
bytes and its *shift*, how far before its own place they start (0 for a chunk's first
frame). A read's chunks start only at frames with shift 0, so a chunk's stored bytes
always lie inside its own raw range and its staging buffer; a reader with smaller
buffers than the writer's is refused in one line. Every frame's checksum covers its
stored bytes at the offsets they were stored at.

Note [shared inodes]: a bucket file's inode may have more than one name: a checkpoint
written in the step links the new bucket files into its dir (``optim.instep``), a load
links a checkpoint's files in, and a user may keep a ``cp -l`` backup. Bytes written in
place would land in every name, so a file with its checksums in it is never written
while ``fstat`` counts more than one link (the writer, ``optim.store``, gives such a
bucket a new inode and renames it over the live name; this check in ``write`` is the
last line, one ``fstat`` per chunk).

Note [failing fast]: a driver or worker thread never dies with a transfer unfinished.
An exception while splitting a transfer fails the chunks not yet handed out; one in a
worker fails its chunk; either way the transfer completes with the error and
``wait()``/``drain()``/``close()`` raise it. ``drain()`` waits for every transfer before
it raises, so no I/O is in flight afterwards. OS errors name the file, the operation,
the offset and the state the file holds.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import os
import queue
import threading
import zlib
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from greenroom import compression, fs
from greenroom.errors import ConfigError, IntegrityError, StorageError

ALIGNMENT = 4096
DEFAULT_DEPTH = 4
EXTENT = 1 << 20  # bytes per checksum, see Note [integrity]
_SUM_BYTES = 8
STORE_RAW = 0  # the element size of a region a codec need not try (incompressible: stored as it is)
_STORED_BYTES = 8  # per extent of a compressed file: its frame's stored bytes and shift (Note [packed frames])


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def verify_default() -> bool:
    """Whether transfers are checksummed: ``GREENROOM_VERIFY`` (1, the default, or 0)."""
    value = os.environ.get("GREENROOM_VERIFY", "1")
    if value not in ("0", "1"):
        raise ConfigError(f"GREENROOM_VERIFY={value!r}: expected 1 (verify every read, the default) or 0 "
                         "(measurement only)")
    return value == "1"


def _signed(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


def _mix(x: int) -> int:
    """splitmix64's finalizer: fixed, well-spread 64-bit constants from an index."""
    x = (x + 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return x ^ (x >> 31)


def _engine_owned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in numpy-owned memory. The portable actor offload moves every
    torch-owned (resizable) storage it can reach; the engine's own bookkeeping must stay
    put while the actor sleeps, since the wake's reads are verified with it."""
    return torch.from_numpy(t.numpy().copy())


_WORDS_PER_PAGE = ALIGNMENT // 8
_LANES = _engine_owned(torch.tensor([_signed(_mix(j) | 1) for j in range(_WORDS_PER_PAGE)], dtype=torch.int64))
_PAGE_A = _signed(_mix(1 << 20) | 1)
_PAGE_B = _signed(_mix(1 << 21))


def page_sums(buf: torch.Tensor, file_offset: int) -> torch.Tensor:
    """Each 4 KiB page's share of the checksum (Note [integrity]) of ``buf``, bytes that
    sit at ``file_offset`` of a file; ``buf`` is whole pages of 8-byte aligned host memory."""
    assert buf.numel() % ALIGNMENT == 0 and file_offset % ALIGNMENT == 0
    words = buf.view(torch.int64).view(-1, _WORDS_PER_PAGE)
    pages = torch.arange(file_offset // ALIGNMENT, file_offset // ALIGNMENT + words.shape[0], dtype=torch.int64)
    return (words @ _LANES) * ((pages * _PAGE_A + _PAGE_B) | 1)


def extent_sums(buf: torch.Tensor, file_offset: int) -> torch.Tensor:
    """The checksum of every ``EXTENT`` of the file that ``buf`` (at ``file_offset``)
    touches, counting only ``buf``'s bytes."""
    sums = page_sums(buf, file_offset)
    first = file_offset // EXTENT
    index = (torch.arange(sums.numel(), dtype=torch.int64) * ALIGNMENT + file_offset) // EXTENT - first
    return torch.zeros(int(index[-1]) + 1 if sums.numel() else 0, dtype=torch.int64).index_add_(0, index, sums)


def _aligned_host(nbytes: int) -> torch.Tensor:
    backing = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8)
    skew = (-backing.data_ptr()) % ALIGNMENT
    return backing[skew:skew + nbytes]


def _os_error(path: str, label: str, op: str, nbytes: int, offset: int, e: OSError) -> StorageError:
    """One line naming the file, the operation and what to do about it."""
    name = errno.errorcode.get(e.errno, str(e.errno))
    advice = {errno.ENOSPC: "the disk is full: free space or point --offload-train-disk-dir at a larger disk",
              errno.EDQUOT: "the disk quota is exhausted: free space or raise the quota",
              errno.EIO: "the device reported an I/O error: check the disk (dmesg); the state in this file is lost",
              errno.EROFS: "the filesystem went read-only (often after an I/O error): check the disk (dmesg)"}
    return StorageError(f"{path}: {op} of {nbytes} bytes at offset {offset} of {label} failed: "
                        f"{e.strerror or e} ({name}); " + advice.get(e.errno, "check the disk and the dir"))




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
            raise error(f"{path}: file ended at offset {offset + done}, "
                        f"expected {len(buf) - done} more bytes (truncated?)")
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
        compression: the frame codec of ``greenroom.compression`` that transfers of this
            file run (None: bytes stored as they are). The file keeps its raw size; what
            and where each frame stored is recorded with the checksums (Note [packed frames]).

    Running out of space is a ``StorageError`` here, at setup, never a SIGBUS or
    garbage later; a partially created file is removed.
    """

    def __init__(self, path: str, size: int, *, create: bool = True, direct: bool | None = None,
                 label: str = "a state file",
                 checksums: str = "memory", compression=None) -> None:
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
                        "or written by a different layout; it cannot be read")
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
                    "--offload-train-disk-dir at a larger disk") from None
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

    # -- blocking I/O -------------------------------------------------------------
    def write(self, buf: memoryview, file_offset: int) -> int:
        """Write all of ``buf`` at ``file_offset``; returns the bytes written. A file with
        its checksums in it is refused while another name links its inode (Note [shared
        inodes])."""
        self._check_range(len(buf), file_offset)
        try:
            if self.table_offset is not None and os.fstat(self.fd).st_nlink > 1:
                raise StorageError(f"{self.path}: refusing to write {self.label} in place: its inode has "
                                   f"{os.fstat(self.fd).st_nlink} links (a checkpoint or a hard-linked backup "
                                   "shares it); greenroom writes such a bucket to a new file instead, so this is "
                                   "a bug: report it")
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
    def record_sums(self, offset: int, nbytes: int, sums: torch.Tensor | None,
                    stored: torch.Tensor | None = None) -> None:
        """Keep the extent sums of the range just written (``nbytes`` aligned), and for a
        compressed file each extent's frame's stored bytes and shift (Note [packed frames])."""
        if self.table_offset is None:
            with self._sums_lock:
                end = offset + nbytes
                # A range written differently before (another layout) no longer holds.
                for records in (self._sums, self._stored):
                    for key in [k for k in records if k[0] < end and offset < k[0] + k[1]]:
                        del records[key]
                if sums is not None:
                    self._sums[(offset, nbytes)] = _engine_owned(sums)
                if stored is not None:
                    self._stored[(offset, nbytes)] = _engine_owned(stored)
            return
        assert offset == 0 and nbytes == self.data_bytes, "a file with its checksums in it is written whole"
        extents = (nbytes + EXTENT - 1) // EXTENT
        table = _aligned_host(self.table_bytes(self.size, compressed=self.compression is not None))
        table.zero_()
        if sums is not None:
            table[:extents * _SUM_BYTES].view(torch.int64).copy_(sums)
        if stored is not None:
            table[extents * _SUM_BYTES:extents * (_SUM_BYTES + _STORED_BYTES)].view(torch.int32).view(-1, 2).copy_(stored)
        self.write(memoryview(table.numpy()), self.table_offset)
        # What a checkpoint's manifest records of a file it did not read (optim.instep).
        self.table_crc32 = f"{zlib.crc32(memoryview(table.numpy())):08x}"

    def _table(self, offset: int, nbytes: int) -> tuple[torch.Tensor, int]:
        assert offset == 0 and nbytes == self.data_bytes, "a file with its checksums in it is read whole"
        table = _aligned_host(self.table_bytes(self.size, compressed=self.compression is not None))
        self.read(memoryview(table.numpy()), self.table_offset)
        return table, (nbytes + EXTENT - 1) // EXTENT

    def recorded(self, offset: int, nbytes: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What was recorded when the range was written: its extent sums, and for a
        compressed file each frame's stored bytes and shift (None: nothing recorded since
        the file was opened). One read of the table of a file that holds it."""
        if self.table_offset is None:
            with self._sums_lock:
                return self._sums.get((offset, nbytes)), self._stored.get((offset, nbytes))
        table, extents = self._table(offset, nbytes)
        sums = table[:extents * _SUM_BYTES].view(torch.int64).clone()
        stored = None
        if self.compression is not None:
            stored = table[extents * _SUM_BYTES:extents * (_SUM_BYTES + _STORED_BYTES)].view(torch.int32).view(-1, 2)
            stored = stored.clone() if bool((stored[:, 0] > 0).all()) else None
        return sums, stored

    def _check_range(self, length: int, file_offset: int) -> None:
        # Errors, not asserts: a caller's bad range must fail under ``python -O`` too.
        if file_offset < 0 or file_offset + length > self.allocated:
            raise ConfigError(f"{self.path}: I/O [{file_offset}, {file_offset + length}) outside the file's "
                             f"{self.allocated} bytes")
        if self.direct and (file_offset % ALIGNMENT or length % ALIGNMENT):
            raise ConfigError(f"{self.path}: O_DIRECT I/O needs {ALIGNMENT}-byte aligned offsets and lengths, got "
                             f"[{file_offset}, {file_offset + length}) (see Note [alignment])")

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


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    assert t.is_contiguous(), "transfers need contiguous tensors"
    return t.reshape(-1).view(torch.uint8)


class StagingBuffers:
    """``depth`` aligned host buffers whose sizes add up to at most ``total_bytes``.

    Pinned when CUDA is available, so device copies are true DMA and can overlap.
    """

    def __init__(self, total_bytes: int, depth: int = DEFAULT_DEPTH, *, pin: bool | None = None) -> None:
        if pin is None:
            pin = torch.cuda.is_available()
        each = max(ALIGNMENT, total_bytes // depth // ALIGNMENT * ALIGNMENT)
        self.buffer_bytes = each
        self.pinned = pin
        backing = torch.empty(each * depth + ALIGNMENT, dtype=torch.uint8, pin_memory=pin)
        skew = (-backing.data_ptr()) % ALIGNMENT
        self._backing = backing
        self.buffers = [backing[skew + i * each: skew + (i + 1) * each] for i in range(depth)]
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(depth):
            self._free.put(i)

    @property
    def total_bytes(self) -> int:
        return self.buffer_bytes * len(self.buffers)

    def acquire(self) -> int:
        return self._free.get()

    def release(self, index: int) -> None:
        self._free.put(index)


@dataclass(eq=False)
class Transfer:
    """The future of one tensor transfer; ``wait()`` returns the bytes moved."""

    nbytes: int
    chunks: int
    file: "StateFile | None" = None
    offset: int = 0
    sums: torch.Tensor | None = None
    """Extent sums accumulated chunk by chunk (Note [integrity]); None when not verifying."""
    stored: torch.Tensor | None = None
    """Of a compressed file, per extent: its frame's stored bytes and how far before its
    own place they were stored (int32 pairs, Note [packed frames]; filled by a write,
    recorded before a read)."""
    expected: torch.Tensor | None = None
    """Of a read: the recorded extent sums, when fetched with ``stored`` (one table read)."""
    mirror: "StateFile | None" = None
    """Of a write: a second file that gets the same stored bytes and table (an in-step
    checkpoint's copy, ``greenroom.optim.instep``)."""
    _finish: Callable[["Transfer"], None] | None = None
    _remaining: int = 0
    _error: BaseException | None = None
    _reported: bool = False
    _done: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._remaining = self.chunks
        if self.chunks == 0:
            self._complete()

    def _chunk_finished(self, error: BaseException | None, sums: torch.Tensor | None = None,
                        first_extent: int = 0, count: int = 1) -> None:
        """``count`` chunks are over (with ``error``, or adding ``sums`` from ``first_extent``)."""
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            if sums is not None and self.sums is not None:
                self.sums[first_extent:first_extent + sums.numel()] += sums
            self._remaining -= count
            last = self._remaining == 0
        if last:
            self._complete()

    def _complete(self) -> None:
        # The last chunk's thread records or checks the sums before anyone may use the
        # bytes: a read's wait() raises IntegrityError instead of returning.
        try:
            if self._error is None and self._finish is not None:
                self._finish(self)
        except BaseException as e:
            self._error = e
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> int:
        self._done.wait()
        if self._error is not None:
            self._reported = True
            raise self._error
        return self.nbytes

    def unreported_error(self) -> bool:
        """Whether the transfer failed and nobody has seen its error yet."""
        return self._error is not None and not self._reported

    def _wait_unreported(self) -> None:
        """Like wait(), but an error some caller already saw is not raised twice."""
        self._done.wait()
        if self._error is not None and not self._reported:
            self.wait()


class TransferEngine:
    """Tensor <-> ``StateFile`` transfers through bounded staging, overlapped.

    Args:
        chunk_bytes: total staging host memory (the ``--offload-train-disk-chunk-mb``
            budget); split into ``depth`` buffers.
        depth: number of staging buffers, and of I/O worker threads.
        pin: pin the staging memory (default: when CUDA is available).
        verify: checksum every write and verify every read (Note [integrity]); default
            ``GREENROOM_VERIFY`` (on). Off is for measuring the cost only.

    Transfers are processed in submission order, chunk by chunk; a transfer submitted
    while another is in flight starts as soon as a buffer frees, so a read of the next
    bucket overlaps with the write-back of the previous one.
    """

    def __init__(self, chunk_bytes: int, *, depth: int = DEFAULT_DEPTH, pin: bool | None = None,
                 verify: bool | None = None) -> None:
        self.verify = verify_default() if verify is None else verify
        self.staging = StagingBuffers(chunk_bytes, depth, pin=pin)
        self._thread = threading.local()  # each I/O thread's CUDA stream
        self._workers = cf.ThreadPoolExecutor(max_workers=depth, thread_name_prefix="greenroom-io")
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._inflight: list[Transfer] = []
        self._driver = threading.Thread(target=self._drive, name="greenroom-io-driver", daemon=True)
        self._driver.start()
        self._closed = False

    # -- public API ---------------------------------------------------------------
    def write(self, src: torch.Tensor, file: StateFile, offset: int, *,
              element_sizes: tuple[tuple[int, int], ...] | None = None, mirror: StateFile | None = None) -> Transfer:
        """Write ``src``'s bytes to ``file`` at ``offset`` (4 KiB aligned).

        ``element_sizes``: for a compressed file, ``(byte offset in src, element size)``
        pairs, ascending from 0, telling the codec how wide the elements of each region are
        (``src`` may be raw bytes holding several dtypes); default ``src``'s own.
        ``STORE_RAW`` marks a region no codec can shrink: its frames are stored as they
        are, without trying.
        ``mirror``: a file of the same layout that gets every byte written to ``file``
        from the same staging buffer, and the same checksum table: a second copy for
        the price of a second write, no read.
        """
        return self._submit("write", src, file, offset, element_sizes, mirror)

    def read(self, dst: torch.Tensor, file: StateFile, offset: int) -> Transfer:
        """Fill ``dst`` from ``file`` at ``offset`` (4 KiB aligned)."""
        return self._submit("read", dst, file, offset, None)

    def drain(self) -> None:
        """Wait for every transfer submitted so far, then raise the first error: when it
        raises, no I/O of this engine is in flight any more."""
        pending, self._inflight = self._inflight, []
        first = None
        for t in pending:
            try:
                t._wait_unreported()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.drain()
        finally:
            self._jobs.put(None)
            self._driver.join()
            self._workers.shutdown(wait=True)

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- machinery ----------------------------------------------------------------
    def _submit(self, kind: str, tensor: torch.Tensor, file: StateFile, offset: int, element_sizes,
                mirror: StateFile | None = None) -> Transfer:
        assert not self._closed
        assert offset % ALIGNMENT == 0, "see Note [alignment]"
        data = _byte_view(tensor)
        nbytes = data.numel()
        assert offset + nbytes <= file.data_bytes, f"{file.path}: transfer past the end of the file's data"
        step = self.staging.buffer_bytes
        sums = stored = expected = finish = None
        if self.verify and nbytes:
            end = offset + align_up(nbytes)
            sums = torch.zeros((end - 1) // EXTENT - offset // EXTENT + 1, dtype=torch.int64)
            finish = self._seal if kind == "write" else self._check
        if file.compression is None:
            chunks = [(start, min(step, nbytes - start), None) for start in range(0, nbytes, step)]
        elif not nbytes:
            chunks = []
        elif kind == "write":
            chunks = _frame_chunks(offset, nbytes, step, element_sizes or ((0, tensor.element_size()),), file)
            stored = torch.zeros((sum(len(frames) for _, _, frames in chunks), 2), dtype=torch.int32)
            finish = self._seal
        else:
            expected, stored = file.recorded(offset, align_up(nbytes))
            if stored is None:
                raise IntegrityError(f"{file.path}: no record of bytes [{offset}, {offset + nbytes}) of "
                                     f"{file.label}: they were not written through greenroom's I/O engine "
                                     "since the file was opened, so they cannot be read")
            chunks = _frame_chunks(offset, nbytes, step, element_sizes or ((0, tensor.element_size()),), file,
                                   shifts=stored[:, 1].tolist(), buffers=len(self.staging.buffers))
        transfer = Transfer(nbytes=nbytes, chunks=len(chunks), file=file, offset=offset, sums=sums, stored=stored,
                            mirror=mirror, expected=expected, _finish=finish)
        ready = None
        if data.is_cuda:
            # Copies must see everything the caller's stream has queued on the tensor.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(data.device))
        # A finished transfer leaves the list only once nothing is left to report: one that
        # failed stays until drain() raises its error (a caller waiting on the engine alone
        # must see every failure, not just those of transfers still running).
        self._inflight = [t for t in self._inflight if not t.done() or t.unreported_error()] + [transfer]
        self._jobs.put((kind, data, file, offset, transfer, ready, chunks))
        return transfer

    def _drive(self) -> None:
        copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        while True:
            job = self._jobs.get()
            if job is None:
                return
            # One call per job, so the driver holds no reference to a finished job's
            # tensor while it waits for the next (the caller may free that memory).
            transfer = job[4]
            handed_out = [0]
            try:
                self._split_into_chunks(*job, copy_streams, handed_out)
            except BaseException as e:  # Note [failing fast]
                if handed_out[0] < transfer.chunks:
                    transfer._chunk_finished(e, count=transfer.chunks - handed_out[0])
            del job, transfer

    def _split_into_chunks(self, kind, data, file, offset, transfer, ready, chunks, copy_streams, handed_out) -> None:
        stream = None
        if data.is_cuda:
            stream = copy_streams.setdefault(data.device, torch.cuda.Stream(data.device))
            stream.wait_event(ready)
        on_device = file.compression is not None and file.compression.on_device and data.is_cuda
        for start, n, frames in chunks:
            slot = self.staging.acquire()
            try:
                piece = data[start:start + n]
                done_copy = None
                if kind == "write" and not on_device:
                    done_copy = self._stage_out(piece, slot, stream)  # a device codec reads the device bytes
                if frames is None:
                    task = self._write_chunk if kind == "write" else self._read_chunk
                    self._workers.submit(task, piece, slot, file, offset + start, transfer, done_copy, stream)
                else:
                    task = self._write_frames if kind == "write" else self._read_frames
                    self._workers.submit(task, piece, slot, file, offset + start, frames, transfer, done_copy,
                                         stream)
            except BaseException:
                self.staging.release(slot)
                raise
            handed_out[0] += 1

    def _stage_out(self, piece: torch.Tensor, slot: int, stream) -> torch.cuda.Event | None:
        buf = self.staging.buffers[slot]
        if stream is None:
            buf[:piece.numel()].copy_(piece)
            return None
        with torch.cuda.stream(stream):
            buf[:piece.numel()].copy_(piece, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def _sums_of(self, staged: torch.Tensor, file_offset: int, transfer: Transfer) -> tuple:
        if transfer.sums is None:
            return None, 0
        return extent_sums(staged, file_offset), file_offset // EXTENT - transfer.offset // EXTENT

    @staticmethod
    def _seal(transfer: Transfer) -> None:
        transfer.file.record_sums(transfer.offset, align_up(transfer.nbytes), transfer.sums, transfer.stored)
        if transfer.mirror is not None:
            transfer.mirror.record_sums(transfer.offset, align_up(transfer.nbytes), transfer.sums, transfer.stored)

    @staticmethod
    def _check(transfer: Transfer) -> None:
        check_sums(transfer.file, transfer.offset, align_up(transfer.nbytes), transfer.sums, transfer.expected)

    def _write_chunk(self, piece, slot, file, file_offset, transfer, done_copy, stream) -> None:
        error = sums = None
        first = 0
        try:
            if done_copy is not None:
                done_copy.synchronize()
            buf = self.staging.buffers[slot]
            n = piece.numel()
            if n % ALIGNMENT:
                buf[n:align_up(n)].zero_()  # deterministic padding in the file's slack
            staged = buf[:align_up(n)]
            sums, first = self._sums_of(staged, file_offset, transfer)
            file.write(memoryview(staged.numpy()), file_offset)
            if transfer.mirror is not None:
                transfer.mirror.write(memoryview(staged.numpy()), file_offset)
        except BaseException as e:  # reported through Transfer.wait()
            error = e
        finally:
            self.staging.release(slot)
            transfer._chunk_finished(error, sums, first)

    def _read_chunk(self, piece, slot, file, file_offset, transfer, done_copy, stream) -> None:
        error = sums = None
        first = 0
        try:
            buf = self.staging.buffers[slot]
            n = piece.numel()
            staged = buf[:align_up(n)]
            file.read(memoryview(staged.numpy()), file_offset)
            if stream is None:
                piece.copy_(buf[:n])
                sums, first = self._sums_of(staged, file_offset, transfer)
            else:
                with torch.cuda.stream(stream):
                    piece.copy_(buf[:n], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                # Hash while the DMA reads the same buffer; the caller learns of a
                # mismatch from wait() before it may touch ``piece``.
                sums, first = self._sums_of(staged, file_offset, transfer)
                event.synchronize()  # the staging buffer is reused once released
        except BaseException as e:
            error = e
        finally:
            self.staging.release(slot)
            transfer._chunk_finished(error, sums, first)

    # -- compressed files (greenroom.compression) -------------------------------------
    def _io_stream(self, device: torch.device) -> torch.cuda.Stream:
        """This I/O thread's own stream on ``device``: codec kernels of concurrent chunks
        run side by side, and never queue behind the driver's copies."""
        streams = getattr(self._thread, "streams", None)
        if streams is None:
            streams = self._thread.streams = {}
        if device not in streams:
            streams[device] = torch.cuda.Stream(device)
        return streams[device]

    def _write_frames(self, piece, slot, file, chunk_offset, frames, transfer, done_copy, stream) -> None:
        """Compress the chunk's frames and write them packed (Note [packed frames]): each a
        header and the payload, or the raw bytes where compression does not pay."""
        error = sums = None
        first = frames[0][3]
        try:
            codec = file.compression
            buf = self.staging.buffers[slot]
            arr = buf.numpy()
            header = compression.HEADER_BYTES
            lengths, places, at = [], [], 0
            if codec.on_device and piece.is_cuda:
                io_stream = self._io_stream(piece.device)
                io_stream.wait_stream(stream)
                views = [piece[pos:pos + raw] for pos, raw, _, _ in frames]
                coded = [k for k, (_, _, size, _) in enumerate(frames) if size != STORE_RAW]
                payloads = [None] * len(frames)
                if coded:
                    for k, payload in zip(coded, codec.encode([views[k] for k in coded],
                                                              [frames[k][2] for k in coded], io_stream)):
                        payloads[k] = payload
                with torch.cuda.stream(io_stream):
                    for (pos, raw, size, _), view, payload in zip(frames, views, payloads):
                        if payload is not None and compression.pays(raw, payload.numel()):
                            _put_header(arr, at, codec, size, raw, payload.numel())
                            buf[at + header:at + header + payload.numel()].copy_(payload, non_blocking=True)
                            lengths.append(header + payload.numel())
                        else:
                            buf[at:at + raw].copy_(view, non_blocking=True)
                            lengths.append(raw)
                        places.append(at)
                        at += align_up(lengths[-1])
                io_stream.synchronize()
                del payloads
            else:
                if done_copy is not None:
                    done_copy.synchronize()
                # In place, front to back: a frame's stored bytes end before the next
                # frame's raw bytes begin, so no frame is overwritten before it is encoded.
                for pos, raw, size, _ in frames:
                    # A host tensor in a file of a device codec is stored as it is.
                    payload = None if codec.on_device or size == STORE_RAW else codec.encode(arr[pos:pos + raw], size)
                    if payload is not None and compression.pays(raw, len(payload)):
                        _put_header(arr, at, codec, size, raw, len(payload))
                        arr[at + header:at + header + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
                        lengths.append(header + len(payload))
                    else:
                        if at != pos:
                            arr[at:at + raw] = arr[pos:pos + raw]  # numpy copies overlapping ranges safely
                        lengths.append(raw)
                    places.append(at)
                    at += align_up(lengths[-1])
            for place, n in zip(places, lengths):
                buf[place + n:place + align_up(n)].zero_()  # deterministic padding in the frame's own pages
            transfer.stored[first:first + len(frames)] = torch.tensor(
                [[n, pos - place] for (pos, _, _, _), n, place in zip(frames, lengths, places)], dtype=torch.int32)
            runs = _merge([(place, place + align_up(n)) for place, n in zip(places, lengths)])
            for start, end in runs:
                file.write(memoryview(arr[start:end]), chunk_offset + start)
                if transfer.mirror is not None:
                    transfer.mirror.write(memoryview(arr[start:end]), chunk_offset + start)
            if transfer.sums is not None:
                sums = _frame_sums(buf, chunk_offset, runs, lengths)
        except BaseException as e:  # reported through Transfer.wait()
            error = e
        finally:
            self.staging.release(slot)
            transfer._chunk_finished(error, sums, first)

    def _read_frames(self, piece, slot, file, chunk_offset, frames, transfer, done_copy, stream) -> None:
        """Read the chunk's stored bytes (Note [packed frames]), check them, decode, and fill ``piece``."""
        error = sums = None
        first = frames[0][3]
        try:
            buf = self.staging.buffers[slot]
            arr = buf.numpy()
            header = compression.HEADER_BYTES
            lengths, places, end = [], [], 0
            for (pos, raw, _, _), (n, shift) in zip(frames, transfer.stored[first:first + len(frames)].tolist()):
                place = pos - shift
                if not 0 < n <= raw or (n < raw and n <= header) or shift % ALIGNMENT or not end <= place <= pos:
                    raise IntegrityError(f"{file.path}: frame at offset {chunk_offset + pos} of {file.label}: the "
                                         f"file records {n} stored bytes at {shift} bytes before it for a frame of "
                                         f"{raw}: the record is damaged; stopped before using it: restart from the "
                                         "last checkpoint")
                lengths.append(n)
                places.append(place)
                end = place + align_up(n)
            runs = _merge([(place, place + align_up(n)) for place, n in zip(places, lengths)])
            for start, stop in runs:
                file.read(memoryview(arr[start:stop]), chunk_offset + start)
            if transfer.sums is not None:  # of the stored bytes, before decoding overwrites them
                sums = _frame_sums(buf, chunk_offset, runs, lengths)
            on_device, on_host = [], []
            for (pos, raw, _, _), n, place in zip(frames, lengths, places):
                if n == raw:
                    on_host.append((pos, raw, place, n, None, 1, ""))
                    continue
                where = f"{file.path}: frame at offset {chunk_offset + pos} of {file.label}"
                codec_id, size = compression.parse_header(arr[place:place + header].tobytes(), raw_bytes=raw,
                                                          stored_bytes=n, where=where)
                codec = compression.codec_by_id(codec_id, where)
                (on_device if codec.on_device else on_host).append((pos, raw, place, n, codec, size, where))
            io_stream = None
            if piece.is_cuda or on_device:
                device = piece.device if piece.is_cuda else torch.device("cuda", torch.cuda.current_device())
                io_stream = self._io_stream(device)
                if stream is not None:
                    io_stream.wait_stream(stream)  # the caller's work on ``piece`` comes first
            outs = []
            if on_device:
                # First: the payloads are copied to the device before any frame below is
                # unpacked over them.
                with torch.cuda.stream(io_stream):
                    outs = [piece[pos:pos + raw] if piece.is_cuda else torch.empty(raw, dtype=torch.uint8,
                                                                                   device=io_stream.device)
                            for pos, raw, _, _, _, _, _ in on_device]
                # The chunk's stored bytes from its first device frame to its last go to
                # the device in one copy; each payload decodes from its offset in it.
                base = on_device[0][2]
                top = max(place + n for _, _, place, n, _, _, _ in on_device)
                on_device[0][4].decode(buf[base:top], [(place + header - base, n - header)
                                                       for _, _, place, n, _, _, _ in on_device],
                                       outs, [job[5] for job in on_device], io_stream, [job[6] for job in on_device])
            # Back to front, in place: a frame unpacks over the stored bytes of itself and
            # of the frames after it (already unpacked), never of the frames before it.
            for pos, raw, place, n, codec, size, where in reversed(on_host):
                if codec is not None:
                    codec.decode(memoryview(arr[place + header:place + n]), arr[pos:pos + raw], size, where)
                elif place != pos:
                    arr[pos:pos + raw] = arr[place:place + raw]
            in_buffer = _merge([(pos, pos + raw) for pos, raw, _, _, _, _, _ in on_host])
            if io_stream is not None:
                with torch.cuda.stream(io_stream):
                    for start, stop in in_buffer:
                        piece[start:stop].copy_(buf[start:stop], non_blocking=True)
                io_stream.synchronize()  # the staging buffer is reused once released
            else:
                for start, stop in in_buffer:
                    piece[start:stop].copy_(buf[start:stop])
            if not piece.is_cuda:
                for (pos, raw, _, _, _, _, _), out in zip(on_device, outs):
                    piece[pos:pos + raw].copy_(out)
        except BaseException as e:
            error = e
        finally:
            self.staging.release(slot)
            transfer._chunk_finished(error, sums, first)


def _put_header(arr: np.ndarray, pos: int, codec, itemsize: int, raw: int, payload: int) -> None:
    """The header of a compressed frame, at the start of its slot in the staging buffer."""
    arr[pos:pos + compression.HEADER_BYTES] = np.frombuffer(compression.pack_header(codec.id, itemsize, raw, payload),
                                                            dtype=np.uint8)


def _frame_sums(buf: torch.Tensor, chunk_offset: int, runs: list[tuple[int, int]], lengths: list[int]) -> torch.Tensor:
    """Each frame's checksum (Note [integrity]) of the bytes it stored, at the file offsets
    they were stored at: one pass over each run of the chunk's buffer that moved in one I/O
    (the runs hold the frames' aligned stored bytes back to back, in order)."""
    pages = torch.cat([page_sums(buf[start:end], chunk_offset + start) for start, end in runs])
    frame_of_page = torch.repeat_interleave(torch.arange(len(lengths)),
                                            torch.tensor([align_up(n) // ALIGNMENT for n in lengths]))
    return torch.zeros(len(lengths), dtype=torch.int64).index_add_(0, frame_of_page, pages)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, end in ranges:
        if merged and merged[-1][1] == start:
            merged[-1][1] = end
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _frame_chunks(offset: int, nbytes: int, step: int, element_sizes, file: StateFile, shifts=None,
                  buffers: int = DEFAULT_DEPTH) -> list:
    """The chunks of a transfer of a compressed file: whole frames (one per ``EXTENT`` of
    the file that the transfer touches), at most ``step`` bytes together. Each chunk is
    ``(start in the transfer, bytes, [(start in the chunk, bytes, element size, frame
    index)])``; a frame's element size is that of the region it starts in, or 1 where it
    does not divide the frame. A read passes the recorded ``shifts`` (Note [packed
    frames]): its chunks start only at frames stored at their own place."""
    if step < EXTENT:
        raise ConfigError(f"{file.path}: compression needs staging buffers of at least {EXTENT >> 20} MiB, got "
                          f"{step} bytes: raise --offload-train-disk-chunk-mb to {DEFAULT_DEPTH * EXTENT >> 20} or more")
    frames, position, end = [], offset, offset + nbytes
    while position < end:
        stop = min(end, (position // EXTENT + 1) * EXTENT)
        start, raw = position - offset, stop - position
        size = next(s for at, s in reversed(element_sizes) if at <= start)
        frames.append((start, raw, size if size == STORE_RAW else 1 if raw % size else size))
        position = stop
    chunks, i = [], 0
    while i < len(frames):
        j = i + 1
        while j < len(frames) and frames[j][0] + frames[j][1] - frames[i][0] <= step:
            j += 1
        if shifts is not None and j < len(frames):
            while j > i + 1 and shifts[j]:
                j -= 1
            if shifts[j]:
                # The writer's chunk ran from frame i to the next frame at its own place.
                k = next((k for k in range(j, len(frames)) if not shifts[k]), len(frames))
                span = -(-(frames[k - 1][0] + frames[k - 1][1] - frames[i][0]) // (1 << 20))
                raise ConfigError(f"{file.path}: {file.label} was written through staging buffers of at least "
                                  f"{span} MiB each (--offload-train-disk-chunk-mb {span * buffers} or more), "
                                  f"larger than this run's {step >> 20} MiB each (--offload-train-disk-chunk-mb "
                                  f"{(step * buffers) >> 20}): resume with the chunk size of the run that wrote it")
        chunk_start = frames[i][0]
        chunk_end = frames[j - 1][0] + frames[j - 1][1]
        chunks.append((chunk_start, chunk_end - chunk_start,
                       [(start - chunk_start, raw, size, k) for k, (start, raw, size) in enumerate(frames[i:j], i)]))
        i = j
    return chunks


def verify_mapped(file: StateFile, data: torch.Tensor) -> None:
    """Check bytes of ``file`` that were read around the engine (a memory map of its
    data, from offset 0) against the checksums recorded for them; a no-op when
    verification is off."""
    if verify_default():
        check_sums(file, 0, data.numel(), extent_sums(data, 0))


def check_sums(file: StateFile, offset: int, nbytes: int, sums: torch.Tensor,
               expected: torch.Tensor | None = None) -> None:
    """Raise ``IntegrityError`` (one line: the file, the offset, what it holds) unless
    ``sums`` are the checksums recorded for bytes [offset, offset + nbytes) of ``file``
    (``expected``, when the caller already fetched them)."""
    if expected is None:
        expected = file.recorded(offset, nbytes)[0]
    if expected is None:
        raise IntegrityError(f"{file.path}: no checksum for bytes [{offset}, {offset + nbytes}) of {file.label}: "
                             "they were not written through greenroom's I/O engine since the file was opened, "
                             "so they cannot be verified")
    bad = (sums != expected).nonzero()
    if bad.numel():
        k = int(bad[0]) + offset // EXTENT
        start, end = max(offset, k * EXTENT), min(offset + nbytes, (k + 1) * EXTENT)
        raise IntegrityError(
            f"{file.path}: checksum mismatch at offset {start} (bytes [{start}, {end}) of {file.label}): what "
            "was read back is not what greenroom wrote (a flipped bit, a failing disk or a stray write); "
            "stopped before using it: restart from the last checkpoint")
