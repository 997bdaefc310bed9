"""Where a compressed transfer's frames go: cut into chunks that fit a staging buffer
(``frame_chunks``), and each chunk's stored bytes placed after the one before it
(``Placement``).

Note [compact transfers]: a write stores each chunk's frames right after the previous
chunk's (``Placement``), not at the chunk's own place, so a transfer's stored
bytes are one run from its start: an 8 GiB bf16 actor that stores 5.7 GB reads back as
5.7 GB of contiguous file, where stored at each chunk's own place it left a 20 MiB gap
after every 44 MB. Every chunk's stored bytes still lie inside the transfer's own raw
range (no frame stores more than its raw bytes), so a transfer never touches the bytes
of another, and a unit or bucket rewritten whole fits where it was. A chunk is placed
once the one before it is (chunks take their buffers in order, so the one before is
already running); the first chunk, and one whose frames' shifts could pass
``MAX_SHIFT`` (the record is an int32), start at their own place. The raw disk reads a
contiguous file faster in 4 requests of 64 MiB at a time than in 8 of 16 MiB
(docs/benchmarks.md, 'Design measurements'), and only a contiguous run gives a reader
requests that large (Note [copy while reading] of ``greenroom.io.frames``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from greenroom.errors import ConfigError
from greenroom.io.integrity import EXTENT, align_up

if TYPE_CHECKING:
    from greenroom.io.statefile import StateFile

MAX_SHIFT = 1 << 30
"""The furthest before its own place a write stores a frame (Note [compact transfers])."""

STORE_RAW = 0  # the element size of a region a codec need not try (incompressible: stored as it is)


class Placement:
    """Where the chunks of one compressed write store their frames (Note [compact transfers])."""

    def __init__(self) -> None:
        self._placing = threading.Condition()
        self._next_frame = 0  # the first frame of the chunk to be placed next
        self._cursor: int | None = None  # where the next chunk's stored bytes may start

    def place(self, first_frame: int, count: int, own_place: int, stored_bytes: int, span: int) -> int:
        """The file offset of the stored bytes of a written chunk of ``count`` frames from
        ``first_frame``: right after those of the chunk before it, once that one is placed;
        at ``own_place`` for the first chunk, or where a frame's shift could pass
        ``MAX_SHIFT``. ``span`` is the chunk's raw bytes, aligned."""
        with self._placing:
            self._placing.wait_for(lambda: self._next_frame == first_frame)
            base = self._cursor
            if base is None or own_place + span - base > MAX_SHIFT:
                base = own_place
            self._cursor = base + stored_bytes
            self._next_frame = first_frame + count
            self._placing.notify_all()
        return base


def frame_chunks(
    offset: int, nbytes: int, step: int, element_sizes, file: StateFile, *, buffers: int, stored=None
) -> list:
    """The chunks of a transfer of a compressed file: whole frames (one per ``EXTENT`` of
    the file that the transfer touches) that fit a ``step``-byte staging buffer. Each chunk
    is ``(start in the transfer, bytes, [(start in the chunk, bytes, element size, frame
    index)])``; a frame's element size is that of the region it starts in, or 1 where it
    does not divide the frame. A write's chunk holds at most ``step`` raw bytes. A read
    passes the frames' ``stored`` bytes: its chunk holds at most ``step`` of them where
    the codec decodes on the device (the raw bytes never enter the buffer), else at most
    ``step`` raw bytes, which a host codec unpacks in place (Note [packed frames] of
    ``greenroom.io.frames``)."""
    if step < EXTENT:
        raise ConfigError(
            f"{file.path}: compression needs staging buffers of at least {EXTENT >> 20} MiB, got "
            f"{step} bytes: raise --offload-train-disk-chunk-mb to {buffers * EXTENT >> 20} or more"
        )
    frames, position, end = [], offset, offset + nbytes
    while position < end:
        stop = min(end, (position // EXTENT + 1) * EXTENT)
        start, raw = position - offset, stop - position
        size = next(s for at, s in reversed(element_sizes) if at <= start)
        frames.append((start, raw, size if size == STORE_RAW else 1 if raw % size else size))
        position = stop
    if stored is not None and file.compression.on_device:
        room = [align_up(n) for n in stored]
    else:
        room = [raw for _, raw, _ in frames]
    chunks, i = [], 0
    while i < len(frames):
        j, need = i + 1, room[i]
        while j < len(frames) and need + room[j] <= step:
            need += room[j]
            j += 1
        chunk_start = frames[i][0]
        chunk_end = frames[j - 1][0] + frames[j - 1][1]
        chunks.append(
            (
                chunk_start,
                chunk_end - chunk_start,
                [(start - chunk_start, raw, size, k) for k, (start, raw, size) in enumerate(frames[i:j], i)],
            )
        )
        i = j
    return chunks
