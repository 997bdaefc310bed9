"""Compressed transfers (``greenroom.io.compression``): frames packed per chunk, and their records.

Where a transfer's chunks and their stored bytes go is ``greenroom.io.frame_layout``; the
decoders kept between a read's chunks are ``greenroom.io.kept_decoders``.

Note [packed frames]: a compressed file (``greenroom.io.compression``) is cut into frames,
one per ``EXTENT``; a chunk's frames are stored back to back, each at a page boundary,
and move in one I/O of their stored size (stored at their own places, 1 MiB frames would
go out as ~0.9 MB I/Os and run slower than the raw chunk). Each frame's record holds its
stored bytes and its *shift*, how far before its own place they start. A read places
its chunk's stored bytes back to back in its staging buffer, wherever they lie in the
file, so a frame's bytes there never start after its own place in the chunk: a host
codec unpacks them in place, back to front; a device codec's chunk is cut by its stored
bytes (its raw bytes never enter the buffer), so a reader takes any staging size, the
writer's or not. Every frame's checksum covers its stored bytes at the offsets they
were stored at, and its record (Note [summed records] of ``greenroom.io.statefile``).

Note [decode after the slot]: a read's device frames decode from their one device copy,
after the chunk's staging buffer has gone back to the engine, so the next read into that
buffer runs while they decode. Holding it through the decode would keep the disk waiting: a
wake would have well under its 4 reads in flight while the I/O threads queue for the codec
(docs/benchmarks.md, 'Design measurements'). The engine keeps twice as many I/O threads
as buffers, so a thread that decodes does not hold back one that reads.

Note [copy while reading]: a chunk bound for the device is read in pieces by the engine's
own pool of readers (``DeviceReads``), and each piece is copied to the device as soon as it
is in: the chunk's buffer is free soon after its last byte arrives. Read whole by the
chunk's thread and then copied, the four chunks' reads of a wake shared the disk, finished
together and were copied together, with no read (or one) in flight meanwhile
(docs/benchmarks.md, 'Design measurements'). How large and how many the pieces are depends
on what else the disk does. An engine that reads beside its own writes (a streamed step, the
default ``BESIDE_WRITES``) reads 16 MiB pieces, 8 in flight: all 8 are in flight nearly all
of a wake, and the step keeps its share of the disk against the write-backs. An engine whose
reads have the disk alone (the actor's, whose wake only reads: ``READS_ALONE``) reads each
chunk's stored bytes, contiguous by Note [compact transfers] of ``greenroom.io.frame_layout``,
in one request of up to 64 MiB, 4 in flight: the raw disk reads 4 x 64 MiB requests faster
than 8 x 16 MiB, and so does a wake. A streamed step with 64 MiB pieces ran slower than with 16 MiB x 8, so the step
keeps the default (docs/benchmarks.md, 'Design measurements').

Note [encode before the slot]: a chunk bound for a device codec is encoded before it takes
a staging buffer. The engine's driver hands each such chunk to ``encode_ahead``, up to
``ENCODE_AHEAD`` chunks beyond the one it waits a buffer for, and the chunk's I/O thread
only copies the encoded frames into its buffer and writes them. The codec runs one call at
a time; encoded under its buffer, a chunk holds the buffer while it queues for the codec,
and in a compressed sleep the codec was the largest share of the disk's idle time
(docs/benchmarks.md, 'Actor offload'). Encoded ahead, a sleep kept 3.1-3.3 of its 4 writes
in flight against 2.6-3.4, and a streamed step's codec was busy half as long
(docs/benchmarks.md, 'Design measurements'). The price is device memory: at most
``ENCODE_AHEAD + 1`` chunks' encoded frames beyond those the buffers' threads hold (a
streamed step's HBM 0.63-0.73 GB against 0.55-0.59).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from greenroom.errors import IntegrityError
from greenroom.io import compression
from greenroom.io.frame_layout import STORE_RAW
from greenroom.io.integrity import ALIGNMENT, align_up, page_sums
from greenroom.io.kept_decoders import KeptDecoders
from greenroom.io.timeline import CODEC, DEVICE_COPY, DISK, HOST, SYNC, span

if TYPE_CHECKING:
    from greenroom.io.staging import StagingBuffers
    from greenroom.io.statefile import StateFile
    from greenroom.io.timeline import Timeline


@dataclass(frozen=True)
class DeviceReads:
    """How a chunk bound for the device is read (Note [copy while reading])."""

    piece: int
    """Bytes per read."""

    in_flight: int
    """Reads the engine keeps in flight, over all its buffers."""


BESIDE_WRITES = DeviceReads(piece=16 << 20, in_flight=8)
"""For an engine that reads while it writes (a streamed step's buckets): the default."""

READS_ALONE = DeviceReads(piece=64 << 20, in_flight=4)
"""For an engine whose reads have the disk to themselves (an actor's wake)."""

ENCODE_AHEAD = 2
"""Chunks a driver's encodes run ahead of the chunk waiting for a staging buffer (Note
[encode before the slot])."""


class FrameIO:
    """The chunks of a compressed file's transfers, run on the engine's I/O threads: frames
    packed into the chunk's staging buffer and written (``write``), or read back, checked
    and decoded (``read``). Each releases the chunk's buffer to ``staging`` and then tells
    its transfer the chunk is over.

    ``hashers`` is the engine's pool that takes a write's sums while its buffer is written
    out; ``device_reads`` says how a chunk bound for the device is read, on a pool of readers
    this object owns (Note [copy while reading]), as it owns each I/O thread's CUDA streams
    and the kept decoders (Note [kept decoders] of ``greenroom.io.kept_decoders``).
    """

    def __init__(self, staging: StagingBuffers, hashers: cf.Executor, device_reads: DeviceReads) -> None:
        self.staging = staging
        self.device_reads = device_reads
        self._hashers = hashers
        self._piece_reads = cf.ThreadPoolExecutor(
            max_workers=device_reads.in_flight, thread_name_prefix="greenroom-read"
        )
        self.kept_decoders = KeptDecoders()
        self._thread = threading.local()  # each I/O thread's CUDA streams
        # Note [encode before the slot]: one thread, as the codec runs one call at a time.
        self._encoder = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="greenroom-encode")
        self._encode_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.timeline: Timeline | None = None  # set by the engine's ``record``

    def _read_piece(self, file: StateFile, buf: memoryview, offset: int) -> int:
        with span(self.timeline, DISK):
            return file.read(buf, offset)

    def _sums(self, buf: torch.Tensor, runs: list, lengths: list[int]) -> torch.Tensor:
        with span(self.timeline, HOST):
            return _frame_sums(buf, runs, lengths)

    def close(self) -> None:
        """Shut the pools of piece reads and encodes down, waiting for their threads."""
        self._piece_reads.shutdown(wait=True)
        self._encoder.shutdown(wait=True)

    def encode_ahead(self, piece: torch.Tensor, frames, file: StateFile, stream: torch.cuda.Stream) -> cf.Future:
        """Start encoding the frames of a device chunk that has no staging buffer yet (Note
        [encode before the slot]); called by the engine's driver, after ``stream`` has
        queued the wait for the caller's work on ``piece``. The future's result goes to
        ``write`` as its ``encoded``."""
        encode_stream = self._encode_streams.get(piece.device)
        if encode_stream is None:
            encode_stream = self._encode_streams[piece.device] = torch.cuda.Stream(piece.device)
        encode_stream.wait_stream(stream)  # now, in the driver's thread: what the caller queued
        return self._encoder.submit(self._encode, piece, frames, file.compression, encode_stream)

    def _encode(self, piece: torch.Tensor, frames, codec, stream: torch.cuda.Stream) -> list:
        """Each frame's ``(codec id, payload)`` on the device, ``(None, None)`` for one stored
        raw; the payloads are complete when it returns (the codec synchronizes ``stream``)."""
        coded = [k for k, (_, _, size, _) in enumerate(frames) if size != STORE_RAW]
        payloads = [(None, None)] * len(frames)
        if coded:
            views = [piece[frames[k][0] : frames[k][0] + frames[k][1]] for k in coded]
            with span(self.timeline, CODEC):
                encoded = codec.encode(views, [frames[k][2] for k in coded], stream)
            for k, payload in zip(coded, encoded):
                payloads[k] = payload
        return payloads

    def _io_stream(self, device: torch.device) -> torch.cuda.Stream:
        """This I/O thread's own stream on ``device``: codec kernels of concurrent chunks
        run side by side, and never queue behind the driver's copies."""
        streams = getattr(self._thread, "streams", None)
        if streams is None:
            streams = self._thread.streams = {}
        if device not in streams:
            streams[device] = torch.cuda.Stream(device)
        return streams[device]

    def write(self, piece, slot, file, chunk_offset, frames, transfer, done_copy, stream, encoded=None) -> None:
        """Compress the chunk's frames and write them packed (Note [packed frames]): each a
        header and the payload, or the raw bytes where compression does not pay. A device
        chunk's frames were encoded by ``encode_ahead``: ``encoded`` is its future."""
        error = sums = base = None
        first = frames[0][3]
        raw_span = align_up(piece.numel())
        try:
            codec = file.compression
            buf = self.staging.buffers[slot]
            arr = buf.numpy()
            header = compression.HEADER_BYTES
            lengths, places, at = [], [], 0
            if codec.on_device and piece.is_cuda:
                io_stream = self._io_stream(piece.device)
                io_stream.wait_stream(stream)
                views = [piece[pos : pos + raw] for pos, raw, _, _ in frames]
                with span(self.timeline, SYNC):
                    payloads = encoded.result()
                with span(self.timeline, DEVICE_COPY):
                    with torch.cuda.stream(io_stream):
                        for (pos, raw, size, _), view, (codec_id, payload) in zip(frames, views, payloads):
                            if payload is not None and compression.pays(raw, payload.numel()):
                                _put_header(arr, at, codec_id, size, raw, payload.numel())
                                buf[at + header : at + header + payload.numel()].copy_(payload, non_blocking=True)
                                lengths.append(header + payload.numel())
                            else:
                                buf[at : at + raw].copy_(view, non_blocking=True)
                                lengths.append(raw)
                            places.append(at)
                            at += align_up(lengths[-1])
                    io_stream.synchronize()
                payloads.clear()  # the device memory goes back now: ``encoded`` holds this list too
            else:
                if done_copy is not None:
                    with span(self.timeline, DEVICE_COPY):
                        done_copy.synchronize()
                with span(self.timeline, CODEC):
                    # In place, front to back: a frame's stored bytes end before the next
                    # frame's raw bytes begin, so no frame is overwritten before it is encoded.
                    for pos, raw, size, _ in frames:
                        # A host tensor in a file of a device codec is stored as it is.
                        payload = (
                            None if codec.on_device or size == STORE_RAW else codec.encode(arr[pos : pos + raw], size)
                        )
                        if payload is not None and compression.pays(raw, len(payload)):
                            _put_header(arr, at, codec.id, size, raw, len(payload))
                            arr[at + header : at + header + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
                            lengths.append(header + len(payload))
                        else:
                            if at != pos:
                                arr[at : at + raw] = arr[pos : pos + raw]  # numpy copies overlapping ranges safely
                            lengths.append(raw)
                        places.append(at)
                        at += align_up(lengths[-1])
            for place, n in zip(places, lengths):
                buf[place + n : place + align_up(n)].zero_()  # deterministic padding in the frame's own pages
            with span(self.timeline, SYNC):  # the chunk before it places first
                base = transfer.placement.place(first, len(frames), chunk_offset, at, raw_span)
            transfer.stored[first : first + len(frames)] = torch.tensor(
                [[n, chunk_offset + pos - base - place] for (pos, _, _, _), n, place in zip(frames, lengths, places)],
                dtype=torch.int32,
            )
            runs = [(0, at, base)]  # the frames' stored bytes, back to back
            pending = None if transfer.sums is None else self._hashers.submit(self._sums, buf, runs, lengths)
            try:
                with span(self.timeline, DISK):
                    for target in (file, transfer.mirror):
                        if target is not None:
                            target.write(memoryview(arr[:at]), base)
            finally:
                sums = None if pending is None else pending.result()  # before the buffer is released
        except BaseException as e:  # reported through Transfer.wait()
            error = e
            if base is None:  # the chunks after this one are placed after its raw bytes
                transfer.placement.place(first, len(frames), chunk_offset, raw_span, raw_span)
        finally:
            self.staging.release(slot)
            transfer.chunk_finished(error, sums, first)

    def read(self, piece, slot, file, chunk_offset, frames, transfer, done_copy, stream) -> None:
        """Read the chunk's stored bytes (Note [packed frames]) back to back into its staging
        buffer, check them, decode, and fill ``piece``; the staging slot goes back before the
        device frames decode (Note [decode after the slot])."""
        error = sums = None
        first = frames[0][3]
        held = True
        decoding = contextlib.ExitStack()
        try:
            buf = self.staging.buffers[slot]
            arr = buf.numpy()
            header = compression.HEADER_BYTES
            lengths, places, runs = [], [], []  # runs: [start, stop in the buffer, file offset]
            for (pos, raw, _, _), (n, shift) in zip(frames, transfer.stored[first : first + len(frames)].tolist()):
                stored_at = chunk_offset + pos - shift
                end = runs[-1][2] + runs[-1][1] - runs[-1][0] if runs else 0  # of the stored bytes so far, in the file
                if (
                    not 0 < n <= raw
                    or (n < raw and n <= header)
                    or shift % ALIGNMENT
                    or not end <= stored_at <= chunk_offset + pos
                ):
                    raise IntegrityError(
                        f"{file.path}: frame at offset {chunk_offset + pos} of {file.label}: the "
                        f"file records {n} stored bytes at {shift} bytes before it for a frame of "
                        f"{raw}: the record is damaged; stopped before using it: restart from the "
                        "last checkpoint"
                    )
                place = runs[-1][1] if runs else 0  # in the buffer: back to back, never after ``pos``
                if runs and end == stored_at:
                    runs[-1][1] += align_up(n)
                else:
                    runs.append([place, place + align_up(n), stored_at])
                lengths.append(n)
                places.append(place)
            stored_bytes = runs[-1][1]
            io_stream = packed = None
            to_device = file.compression.on_device and any(n < raw for (_, raw, _, _), n in zip(frames, lengths))
            if piece.is_cuda or to_device:
                device = piece.device if piece.is_cuda else torch.device("cuda", torch.cuda.current_device())
                io_stream = self._io_stream(device)
                if stream is not None:
                    io_stream.wait_stream(stream)  # the caller's work on ``piece`` comes first
            if to_device:
                decoding.enter_context(self.kept_decoders.reading())
                # The chunk's stored bytes go to the device as they arrive (Note [copy while
                # reading]); each payload decodes from its offset there, and the sums are
                # taken there (Note [sums on the device]).
                with torch.cuda.stream(io_stream):
                    packed = torch.empty(stored_bytes, dtype=torch.uint8, device=device)
                step = self.device_reads.piece
                pieces = [
                    (at, min(stop, at + step), stored_at + at - start)
                    for start, stop, stored_at in runs
                    for at in range(start, stop, step)
                ]
                reads = []
                try:
                    for a, b, at in pieces:
                        reads.append(self._piece_reads.submit(self._read_piece, file, memoryview(arr[a:b]), at))
                    for (a, b, _), read in zip(pieces, reads):
                        read.result()
                        with torch.cuda.stream(io_stream):
                            packed[a:b].copy_(buf[a:b], non_blocking=True)
                finally:
                    cf.wait(reads)  # none may still fill the buffer once it is released
                copied = torch.cuda.Event()
                copied.record(io_stream)
            else:
                with span(self.timeline, DISK):
                    for start, stop, stored_at in runs:
                        file.read(memoryview(arr[start:stop]), stored_at)
            on_device, on_host, device_layouts = [], [], []
            for (pos, raw, _, _), n, place in zip(frames, lengths, places):
                if n == raw:
                    on_host.append((pos, raw, place, n, None, 1, ""))
                    continue
                where = f"{file.path}: frame at offset {chunk_offset + pos} of {file.label}"
                codec_id, size = compression.parse_header(
                    arr[place : place + header].tobytes(), raw_bytes=raw, stored_bytes=n, where=where
                )
                codec = compression.codec_by_id(codec_id, where)
                if codec.on_device != file.compression.on_device:
                    raise IntegrityError(
                        f"{where}: the frame names codec {codec.name}, but the file was opened "
                        f"for {getattr(file.compression, 'name', 'none')}: the bytes are damaged "
                        "or another program wrote them; stopped before using them"
                    )
                (on_device if codec.on_device else on_host).append((pos, raw, place, n, codec, size, where))
                if codec.on_device:
                    device_layouts.append((codec_id, size))
            if packed is not None:
                with span(self.timeline, DEVICE_COPY):
                    copied.synchronize()  # before the buffer may be released
            elif transfer.sums is not None:  # of the stored bytes, before unpacking overwrites them
                sums = self._sums(buf, runs, lengths)
            if packed is None:
                # Back to front, in place: a frame unpacks over the stored bytes of itself and
                # of the frames after it (already unpacked), never of the frames before it.
                with span(self.timeline, CODEC):
                    for pos, raw, place, n, codec, size, where in reversed(on_host):
                        if codec is not None:
                            codec.decode(memoryview(arr[place + header : place + n]), arr[pos : pos + raw], size, where)
                        elif place != pos:
                            arr[pos : pos + raw] = arr[place : place + raw]
                copies = _merge([(pos, pos + raw, pos) for pos, raw, _, _, _, _, _ in on_host])
            else:
                # A device codec's chunk holds stored bytes only (``frame_layout.frame_chunks``):
                # its raw frames go to ``piece`` from where they were read.
                copies = _merge([(pos, pos + raw, place) for pos, raw, place, _, _, _, _ in on_host])
            if io_stream is not None:
                with span(self.timeline, DEVICE_COPY):
                    with torch.cuda.stream(io_stream):
                        for start, stop, source in copies:
                            piece[start:stop].copy_(buf[source : source + stop - start], non_blocking=True)
                    io_stream.synchronize()  # the staging buffer is reused once released
            else:
                with span(self.timeline, HOST):
                    for start, stop, source in copies:
                        piece[start:stop].copy_(buf[source : source + stop - start])
            self.staging.release(slot)
            held = False
            if packed is not None:
                device_sums = None
                if transfer.sums is not None:
                    with torch.cuda.stream(io_stream):
                        device_sums = _frame_sums(packed, runs, lengths)
                with torch.cuda.stream(io_stream):
                    outs = [
                        piece[pos : pos + raw]
                        if piece.is_cuda
                        else torch.empty(raw, dtype=torch.uint8, device=io_stream.device)
                        for pos, raw, _, _, _, _, _ in on_device
                    ]
                if on_device:
                    # Note [kept decoders] of greenroom.io.kept_decoders
                    decode_stream, decoders = self.kept_decoders.on(io_stream.device)
                    decode_stream.wait_stream(io_stream)  # ``packed`` and ``outs`` were made there
                    with span(self.timeline, CODEC):
                        on_device[0][4].decode(
                            packed,
                            [(place + header, n - header) for _, _, place, n, _, _, _ in on_device],
                            outs,
                            device_layouts,
                            decode_stream,
                            [job[6] for job in on_device],
                            decoders=decoders,
                        )
                with span(self.timeline, DEVICE_COPY):
                    if device_sums is not None:
                        # Not the legacy default stream: it waits for the whole device.
                        with torch.cuda.stream(io_stream):
                            sums = device_sums.cpu()
                    if not piece.is_cuda:
                        for (pos, raw, _, _, _, _, _), out in zip(on_device, outs):
                            piece[pos : pos + raw].copy_(out)
        except BaseException as e:
            error = e
        finally:
            if held:
                self.staging.release(slot)
            decoding.close()  # before the transfer completes: none is kept once it is waited for
            transfer.chunk_finished(error, sums, first)


def _put_header(arr: np.ndarray, pos: int, codec_id: int, itemsize: int, raw: int, payload: int) -> None:
    """The header of a compressed frame, at the start of its slot in the staging buffer."""
    header = compression.pack_header(codec_id, itemsize, raw, payload)
    arr[pos : pos + compression.HEADER_BYTES] = np.frombuffer(header, dtype=np.uint8)


def _frame_sums(buf: torch.Tensor, runs: list, lengths: list[int]) -> torch.Tensor:
    """Each frame's checksum (Note [integrity]) of the bytes it stored, at the file offsets
    they were stored at: one pass over each run ``(start, stop, file offset)`` of the
    chunk's buffer that moved in one I/O (the runs hold the frames' aligned stored bytes
    back to back, in order)."""
    pages = torch.cat([page_sums(buf[start:stop], stored_at) for start, stop, stored_at in runs])
    frame_of_page = torch.repeat_interleave(
        torch.arange(len(lengths)), torch.tensor([align_up(n) // ALIGNMENT for n in lengths])
    )
    return torch.zeros(len(lengths), dtype=torch.int64, device=buf.device).index_add_(
        0, frame_of_page.to(buf.device, non_blocking=True), pages
    )


def _merge(copies: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Copies ``(start, stop, source)`` joined where both sides run on."""
    merged: list[list[int]] = []
    for start, stop, source in copies:
        if merged and merged[-1][1] == start and merged[-1][2] + start - merged[-1][0] == source:
            merged[-1][1] = stop
        else:
            merged.append([start, stop, source])
    return [(start, stop, source) for start, stop, source in merged]
