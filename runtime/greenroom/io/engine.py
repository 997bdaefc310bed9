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
    up). A driver thread splits each transfer into chunks, one per free buffer; worker
    threads do the disk I/O, so reads run ahead and writes run behind while the caller
    computes. A compressed file's chunks run on them through the engine's ``FrameIO``
    (``greenroom.io.frames``), cut and placed by ``greenroom.io.frame_layout``.

Every transfer is checksummed on its way through the staging buffers and verified
when read back (``greenroom.io.integrity`` Note [integrity]); a compressed file's chunks
are packed frames (``greenroom.io.frames`` Note [packed frames]); every error of any engine
thread reaches the caller of ``wait``/``drain``/``close`` (Note [failing fast]).
``StateFile`` lives in ``greenroom.io.statefile`` (Notes [alignment], [shared inodes]), the
staging buffers in ``greenroom.io.staging`` and ``Transfer``, the future of one transfer, in
``greenroom.io.transfer``; everything is importable from here.

Note [failing fast]: a driver or worker thread never dies with a transfer unfinished.
An exception while splitting a transfer fails the chunks not yet handed out; one in a
worker fails its chunk; either way the transfer completes with the error and
``wait()``/``drain()``/``close()`` raise it. ``drain()`` waits for every transfer before
it raises, so no I/O is in flight afterwards. OS errors name the file, the operation,
the offset and the state the file holds.

Note [interrupted waits]: a wait ends only when its transfer does. SIGTERM (made a
SystemExit by ``greenroom.dirs.rankdir``) and Ctrl-C raise in the main thread wherever it is,
often inside ``wait()`` or ``drain()`` while workers still copy into or out of the
transfer's memory. Raised at once, the exception would unwind into cleanup that frees
that memory: the offloader's failed wake resizes the actor's storages to zero, and a
worker still filling one wrote through a null pointer (a segfault under Slurm's
``scancel``, and the rank dir left behind). So a wait that is interrupted waits again
until the transfer is over, then raises the interruption (its chunks not yet started
run too: at worst the rest of a wake, seconds, well inside Slurm's KillWait and a pod's
grace period), after which every ``finally`` runs on memory no thread is using.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading

import torch

from greenroom.errors import IntegrityError
from greenroom.io import frames
from greenroom.io.frame_layout import STORE_RAW, Placement, frame_chunks
from greenroom.io.frames import FrameIO
from greenroom.io.integrity import ALIGNMENT, EXTENT, align_up, extent_sums, page_sums, verify_default
from greenroom.io.staging import DEFAULT_DEPTH, StagingBuffers
from greenroom.io.statefile import StateFile, aligned_host, check_sums, pread_all, pwrite_all, verify_mapped
from greenroom.io.timeline import DEVICE_COPY, DISK, HOST, Timeline, span
from greenroom.io.transfer import Transfer


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    assert t.is_contiguous(), "transfers need contiguous tensors"
    return t.reshape(-1).view(torch.uint8)


class TransferEngine:
    """Tensor <-> ``StateFile`` transfers through bounded staging, overlapped.

    Args:
        chunk_bytes: total staging host memory (the ``--offload-train-disk-chunk-mb``
            budget); split into ``depth`` buffers.
        depth: number of staging buffers (the I/O worker threads are twice as many).
        pin: pin the staging memory (default: when CUDA is available).
        verify: checksum every write and verify every read (Note [integrity]); default
            ``GREENROOM_VERIFY`` (on). Off is for measuring the cost only.
        device_reads: how a compressed chunk bound for the device is read (Note [copy
            while reading] of ``greenroom.io.frames``): ``BESIDE_WRITES`` or ``READS_ALONE``.

    Transfers are processed in submission order, chunk by chunk; a transfer submitted
    while another is in flight starts as soon as a buffer frees, so a read of the next
    bucket overlaps with the write-back of the previous one.
    """

    def __init__(
        self,
        chunk_bytes: int,
        *,
        depth: int = DEFAULT_DEPTH,
        pin: bool | None = None,
        verify: bool | None = None,
        device_reads: frames.DeviceReads = frames.BESIDE_WRITES,
    ) -> None:
        self.verify = verify_default() if verify is None else verify
        self.staging = StagingBuffers(chunk_bytes, depth, pin=pin)
        # Twice the buffers: a read's worker decodes after its buffer went back
        # (Note [decode after the slot] of greenroom.io.frames), while the next read runs.
        self._workers = cf.ThreadPoolExecutor(max_workers=2 * depth, thread_name_prefix="greenroom-io")
        # A write's sums are taken on one of these while its worker writes the same buffer
        # out: both only read it, and the worker's next chunk starts a hash sooner.
        self._hashers = cf.ThreadPoolExecutor(max_workers=depth, thread_name_prefix="greenroom-hash")
        # The chunks of compressed files, with the pool of their reads bound for the device
        # (Note [copy while reading] of greenroom.io.frames) and their kept decoders
        # (Note [kept decoders] of greenroom.io.kept_decoders).
        self.frame_io = FrameIO(self.staging, self._hashers, device_reads)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._inflight: list[Transfer] = []
        self._driver = threading.Thread(target=self._drive, name="greenroom-io-driver", daemon=True)
        self._driver.start()
        self._closed = False
        self.timeline: Timeline | None = None

    # -- public API ---------------------------------------------------------------
    def write(
        self,
        src: torch.Tensor,
        file: StateFile,
        offset: int,
        *,
        element_sizes: tuple[tuple[int, int], ...] | None = None,
        mirror: StateFile | None = None,
    ) -> Transfer:
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

    def record(self, timeline: Timeline | None) -> None:
        """Record where this engine's time goes into ``timeline`` (``greenroom.io.timeline``),
        from the next transfer on; None stops it."""
        self.timeline = self.frame_io.timeline = timeline

    def drain(self) -> None:
        """Wait for every transfer submitted so far, then raise the first error: when it
        raises, no I/O of this engine is in flight any more (an interruption too, Note
        [interrupted waits])."""
        pending, self._inflight = self._inflight, []
        first = None
        for t in pending:  # each records its own wait (sync) when the engine records
            try:
                t.wait_unreported()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def settle(self) -> None:
        """``drain()`` for a caller that is already raising: wait for every transfer in
        flight and report none of their errors (the caller's exception is the one to
        report). When it returns, the caller may free the memory they used; a signal's
        exception that arrived meanwhile is raised, after the same wait."""
        try:
            self.drain()
        except Exception:
            pass

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
            self._hashers.shutdown(wait=True)
            self.frame_io.close()

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- machinery ----------------------------------------------------------------
    def _submit(
        self,
        kind: str,
        tensor: torch.Tensor,
        file: StateFile,
        offset: int,
        element_sizes,
        mirror: StateFile | None = None,
    ) -> Transfer:
        assert not self._closed
        assert offset % ALIGNMENT == 0, "see Note [alignment]"
        data = _byte_view(tensor)
        nbytes = data.numel()
        assert offset + nbytes <= file.data_bytes, f"{file.path}: transfer past the end of the file's data"
        step = self.staging.buffer_bytes
        sums = stored = expected = finish = placement = None
        if self.verify and nbytes:
            end = offset + align_up(nbytes)
            sums = torch.zeros((end - 1) // EXTENT - offset // EXTENT + 1, dtype=torch.int64)
            finish = self._seal if kind == "write" else self._check
        if file.compression is None:
            chunks = [(start, min(step, nbytes - start), None) for start in range(0, nbytes, step)]
        elif not nbytes:
            chunks = []
        elif kind == "write":
            chunks = frame_chunks(
                offset,
                nbytes,
                step,
                element_sizes or ((0, tensor.element_size()),),
                file,
                buffers=len(self.staging.buffers),
            )
            stored = torch.zeros((sum(len(frames) for _, _, frames in chunks), 2), dtype=torch.int32)
            placement = Placement()
            finish = self._seal
        else:
            expected, stored = file.recorded(offset, align_up(nbytes))
            if stored is None:
                raise IntegrityError(
                    f"{file.path}: no record of bytes [{offset}, {offset + nbytes}) of "
                    f"{file.label}: they were not written through greenroom's I/O engine "
                    "since the file was opened, so they cannot be read"
                )
            chunks = frame_chunks(
                offset,
                nbytes,
                step,
                element_sizes or ((0, tensor.element_size()),),
                file,
                buffers=len(self.staging.buffers),
                stored=stored[:, 0].tolist(),
            )
        transfer = Transfer(
            nbytes=nbytes,
            chunks=len(chunks),
            file=file,
            offset=offset,
            sums=sums,
            stored=stored,
            mirror=mirror,
            expected=expected,
            finish=finish,
            placement=placement,
            timeline=self.timeline,
        )
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
                    transfer.chunk_finished(e, count=transfer.chunks - handed_out[0])
            del job, transfer

    def _split_into_chunks(self, kind, data, file, offset, transfer, ready, chunks, copy_streams, handed_out) -> None:
        stream = None
        if data.is_cuda:
            stream = copy_streams.setdefault(data.device, torch.cuda.Stream(data.device))
            stream.wait_event(ready)
        on_device = file.compression is not None and file.compression.on_device and data.is_cuda
        # Note [encode before the slot] of greenroom.io.frames: a device codec's chunks are
        # encoded up to ENCODE_AHEAD chunks ahead of the one waiting for a buffer.
        encodes: dict[int, cf.Future] = {}
        encoded_ahead = frames.ENCODE_AHEAD + 1 if on_device and kind == "write" else 0  # with the chunk itself
        try:
            for index, (start, n, chunk_frames) in enumerate(chunks):
                for later in range(index, min(len(chunks), index + encoded_ahead)):
                    if later not in encodes:
                        at, size, later_frames = chunks[later]
                        encodes[later] = self.frame_io.encode_ahead(data[at : at + size], later_frames, file, stream)
                slot = self.staging.acquire()
                try:
                    piece = data[start : start + n]
                    done_copy = None
                    if kind == "write" and not on_device:
                        done_copy = self._stage_out(piece, slot, stream)  # a device codec reads the device bytes
                    if chunk_frames is None:
                        task = self._write_chunk if kind == "write" else self._read_chunk
                        self._workers.submit(task, piece, slot, file, offset + start, transfer, done_copy, stream)
                    else:
                        args = (piece, slot, file, offset + start, chunk_frames, transfer, done_copy, stream)
                        if kind == "write":
                            self._workers.submit(self.frame_io.write, *args, encodes.pop(index, None))
                        else:
                            self._workers.submit(self.frame_io.read, *args)
                except BaseException:
                    self.staging.release(slot)
                    raise
                handed_out[0] += 1
        finally:
            # Chunks never handed out: their encodes end before the transfer fails, so none
            # still reads the caller's tensor once its wait returns.
            for pending in encodes.values():
                pending.cancel()
            cf.wait(list(encodes.values()))

    def _stage_out(self, piece: torch.Tensor, slot: int, stream) -> torch.cuda.Event | None:
        buf = self.staging.buffers[slot]
        if stream is None:
            with span(self.timeline, HOST):
                buf[: piece.numel()].copy_(piece)
            return None
        with torch.cuda.stream(stream):
            buf[: piece.numel()].copy_(piece, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def _sums_of(self, staged: torch.Tensor, file_offset: int, transfer: Transfer) -> tuple:
        if transfer.sums is None:
            return None, 0
        with span(self.timeline, HOST):
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
                with span(self.timeline, DEVICE_COPY):
                    done_copy.synchronize()
            buf = self.staging.buffers[slot]
            n = piece.numel()
            if n % ALIGNMENT:
                buf[n : align_up(n)].zero_()  # deterministic padding in the file's slack
            staged = buf[: align_up(n)]
            pending = self._hashers.submit(self._sums_of, staged, file_offset, transfer)
            try:
                with span(self.timeline, DISK):
                    file.write(memoryview(staged.numpy()), file_offset)
                    if transfer.mirror is not None:
                        transfer.mirror.write(memoryview(staged.numpy()), file_offset)
            finally:
                sums, first = pending.result()  # before the buffer is released
        except BaseException as e:  # reported through Transfer.wait()
            error = e
        finally:
            self.staging.release(slot)
            transfer.chunk_finished(error, sums, first)

    def _read_chunk(self, piece, slot, file, file_offset, transfer, done_copy, stream) -> None:
        error = sums = None
        first = 0
        try:
            buf = self.staging.buffers[slot]
            n = piece.numel()
            staged = buf[: align_up(n)]
            with span(self.timeline, DISK):
                file.read(memoryview(staged.numpy()), file_offset)
            if stream is None:
                with span(self.timeline, HOST):
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
                with span(self.timeline, DEVICE_COPY):
                    event.synchronize()  # the staging buffer is reused once released
        except BaseException as e:
            error = e
        finally:
            self.staging.release(slot)
            transfer.chunk_finished(error, sums, first)


# The layers below, importable from here.
__all__ = [
    "ALIGNMENT",
    "DEFAULT_DEPTH",
    "EXTENT",
    "STORE_RAW",
    "StagingBuffers",
    "StateFile",
    "Transfer",
    "TransferEngine",
    "aligned_host",
    "align_up",
    "check_sums",
    "extent_sums",
    "page_sums",
    "pread_all",
    "pwrite_all",
    "verify_default",
    "verify_mapped",
]
