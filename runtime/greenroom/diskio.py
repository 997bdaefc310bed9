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

Note [alignment]: O_DIRECT needs the buffer address, the file offset and the length to
be multiples of the logical block size. Everything here works in 4 KiB units: file
sizes and segment offsets are rounded up to ``ALIGNMENT``, staging buffers are carved
at aligned addresses, and a chunk's tail is padded to the next 4 KiB (the padding lands
in the file's own rounding slack, never in a neighbouring segment).
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import os
import queue
import threading
from dataclasses import dataclass, field

import torch

from greenroom import fs
from greenroom.errors import StorageError

ALIGNMENT = 4096
DEFAULT_DEPTH = 4


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment




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
        executor: thread pool for ``pread``/``pwrite``; a private one by default.

    Running out of space is a ``StorageError`` here, at setup, never a SIGBUS or
    garbage later; a partially created file is removed.
    """

    def __init__(self, path: str, size: int, *, create: bool = True, direct: bool | None = None,
                 executor: cf.Executor | None = None) -> None:
        self.path = path
        self.size = size
        self.allocated = align_up(size)
        self._executor = executor
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        existed = os.path.exists(path)
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
            raise

    def _preallocate(self, existed: bool) -> None:
        try:
            os.posix_fallocate(self.fd, 0, self.allocated)
            if os.fstat(self.fd).st_size != self.allocated:
                os.ftruncate(self.fd, self.allocated)
        except OSError as e:
            if not existed:
                os.unlink(self.path)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageError(
                    f"{self.path}: not enough space to preallocate {fs.human_bytes(self.allocated)} "
                    f"({fs.human_bytes(fs.free_bytes(os.path.dirname(self.path)))} free on "
                    f"{fs.mount_of(self.path).mount_point}); free space or point "
                    "--offload-train-disk-dir at a larger disk") from None
            raise

    # -- blocking I/O -------------------------------------------------------------
    def write(self, buf: memoryview, file_offset: int) -> int:
        """Write all of ``buf`` at ``file_offset``; returns the bytes written."""
        self._check_range(len(buf), file_offset)
        done = pwrite_all(self.fd, buf, file_offset, self.path)
        if not self.direct:
            # Push the pages out and drop them so the page cache does not hold the state.
            os.fdatasync(self.fd)
            os.posix_fadvise(self.fd, file_offset, done, os.POSIX_FADV_DONTNEED)
        return done

    def read(self, buf: memoryview, file_offset: int) -> int:
        """Fill all of ``buf`` from ``file_offset``; returns the bytes read."""
        self._check_range(len(buf), file_offset)
        done = pread_all(self.fd, buf, file_offset, self.path)
        if not self.direct:
            os.posix_fadvise(self.fd, file_offset, done, os.POSIX_FADV_DONTNEED)
        return done

    # -- asynchronous I/O ---------------------------------------------------------
    def pwrite(self, buf: memoryview, file_offset: int = 0) -> cf.Future:
        return self._pool().submit(self.write, buf, file_offset)

    def pread(self, buf: memoryview, file_offset: int = 0) -> cf.Future:
        return self._pool().submit(self.read, buf, file_offset)

    def _pool(self) -> cf.Executor:
        if self._executor is None:
            self._executor = cf.ThreadPoolExecutor(max_workers=DEFAULT_DEPTH, thread_name_prefix="greenroom-io")
        return self._executor

    def _check_range(self, length: int, file_offset: int) -> None:
        assert file_offset >= 0 and file_offset + length <= self.allocated, (
            f"{self.path}: I/O [{file_offset}, {file_offset + length}) outside {self.allocated} bytes")
        if self.direct:
            assert file_offset % ALIGNMENT == 0 and length % ALIGNMENT == 0, "see Note [alignment]"

    def sync(self) -> None:
        """Make everything written durable and drop the file's cached pages."""
        os.fdatasync(self.fd)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

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
    _remaining: int = 0
    _error: BaseException | None = None
    _reported: bool = False
    _done: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._remaining = self.chunks
        if self.chunks == 0:
            self._done.set()

    def _chunk_finished(self, error: BaseException | None) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            self._remaining -= 1
            if self._remaining == 0:
                self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> int:
        self._done.wait()
        if self._error is not None:
            self._reported = True
            raise self._error
        return self.nbytes

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

    Transfers are processed in submission order, chunk by chunk; a transfer submitted
    while another is in flight starts as soon as a buffer frees, so a read of the next
    bucket overlaps with the write-back of the previous one.
    """

    def __init__(self, chunk_bytes: int, *, depth: int = DEFAULT_DEPTH, pin: bool | None = None) -> None:
        self.staging = StagingBuffers(chunk_bytes, depth, pin=pin)
        self._workers = cf.ThreadPoolExecutor(max_workers=depth, thread_name_prefix="greenroom-io")
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._inflight: list[Transfer] = []
        self._driver = threading.Thread(target=self._drive, name="greenroom-io-driver", daemon=True)
        self._driver.start()
        self._closed = False

    # -- public API ---------------------------------------------------------------
    def write(self, src: torch.Tensor, file: StateFile, offset: int) -> Transfer:
        """Write ``src``'s bytes to ``file`` at ``offset`` (4 KiB aligned)."""
        return self._submit("write", src, file, offset)

    def read(self, dst: torch.Tensor, file: StateFile, offset: int) -> Transfer:
        """Fill ``dst`` from ``file`` at ``offset`` (4 KiB aligned)."""
        return self._submit("read", dst, file, offset)

    def drain(self) -> None:
        """Wait for every transfer submitted so far; raises the first error."""
        pending, self._inflight = self._inflight, []
        for t in pending:
            t._wait_unreported()

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
    def _submit(self, kind: str, tensor: torch.Tensor, file: StateFile, offset: int) -> Transfer:
        assert not self._closed
        assert offset % ALIGNMENT == 0, "see Note [alignment]"
        data = _byte_view(tensor)
        nbytes = data.numel()
        assert offset + nbytes <= file.allocated, f"{file.path}: transfer past the end of the file"
        step = self.staging.buffer_bytes
        transfer = Transfer(nbytes=nbytes, chunks=(nbytes + step - 1) // step)
        ready = None
        if data.is_cuda:
            # Copies must see everything the caller's stream has queued on the tensor.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(data.device))
        self._inflight = [t for t in self._inflight if not t.done()] + [transfer]
        self._jobs.put((kind, data, file, offset, transfer, ready))
        return transfer

    def _drive(self) -> None:
        copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        while True:
            job = self._jobs.get()
            if job is None:
                return
            # One call per job, so the driver holds no reference to a finished job's
            # tensor while it waits for the next (the caller may free that memory).
            self._split_into_chunks(*job, copy_streams)
            del job

    def _split_into_chunks(self, kind, data, file, offset, transfer, ready, copy_streams) -> None:
        stream = None
        if data.is_cuda:
            stream = copy_streams.setdefault(data.device, torch.cuda.Stream(data.device))
            stream.wait_event(ready)
        step = self.staging.buffer_bytes
        for start in range(0, transfer.nbytes, step):
            n = min(step, transfer.nbytes - start)
            slot = self.staging.acquire()
            piece = data[start:start + n]
            if kind == "write":
                done_copy = self._stage_out(piece, slot, stream)
                task = self._write_chunk
            else:
                done_copy = None
                task = self._read_chunk
            self._workers.submit(task, piece, slot, file, offset + start, transfer, done_copy, stream)

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

    def _write_chunk(self, piece, slot, file, file_offset, transfer, done_copy, stream) -> None:
        error = None
        try:
            if done_copy is not None:
                done_copy.synchronize()
            buf = self.staging.buffers[slot]
            n = piece.numel()
            if n % ALIGNMENT:
                buf[n:align_up(n)].zero_()  # deterministic padding in the file's slack
            view = memoryview(buf[:align_up(n)].numpy())
            file.write(view, file_offset)
        except BaseException as e:  # reported through Transfer.wait()
            error = e
        finally:
            self.staging.release(slot)
            transfer._chunk_finished(error)

    def _read_chunk(self, piece, slot, file, file_offset, transfer, done_copy, stream) -> None:
        error = None
        try:
            buf = self.staging.buffers[slot]
            n = piece.numel()
            view = memoryview(buf[:align_up(n)].numpy())
            file.read(view, file_offset)
            if stream is None:
                piece.copy_(buf[:n])
            else:
                with torch.cuda.stream(stream):
                    piece.copy_(buf[:n], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                event.synchronize()  # the staging buffer is reused once released
        except BaseException as e:
            error = e
        finally:
            self.staging.release(slot)
            transfer._chunk_finished(error)
