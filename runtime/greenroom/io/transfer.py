"""``Transfer``: the future of one tensor transfer of ``greenroom.io.engine.TransferEngine``.

The engine's threads report each chunk's end to it (``chunk_finished``); the thread that
ends the last chunk records or checks the transfer's checksums (``finish``) before any
caller's ``wait()`` returns, so a read that fails its check raises instead of returning.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from greenroom.io.timeline import SYNC

if TYPE_CHECKING:
    from greenroom.io.frame_layout import Placement
    from greenroom.io.statefile import StateFile
    from greenroom.io.timeline import Timeline


@dataclass(eq=False)
class Transfer:
    """The future of one tensor transfer; ``wait()`` returns the bytes moved."""

    nbytes: int
    chunks: int
    file: "StateFile | None" = None
    offset: int = 0
    sums: torch.Tensor | None = None
    """Extent sums accumulated chunk by chunk (Note [integrity] of ``greenroom.io.integrity``);
    None when not verifying."""
    stored: torch.Tensor | None = None
    """Of a compressed file, per extent: its frame's stored bytes and how far before its
    own place they were stored (int32 pairs, Note [packed frames] of ``greenroom.io.frames``;
    filled by a write, recorded before a read)."""
    expected: torch.Tensor | None = None
    """Of a read: the recorded extent sums, when fetched with ``stored`` (one table read)."""
    mirror: "StateFile | None" = None
    """Of a write: a second file that gets the same stored bytes and table (an in-step
    checkpoint's copy, ``greenroom.optim.checkpoint.instep``)."""
    finish: Callable[["Transfer"], None] | None = None
    """Run by the thread that ends the last chunk, unless a chunk failed: records or checks
    the sums."""
    placement: "Placement | None" = None
    """Of a compressed write: where each chunk's stored bytes go (Note [compact transfers]
    of ``greenroom.io.frame_layout``)."""
    timeline: "Timeline | None" = None
    """Where a caller's wait for it is recorded (``sync``), when the engine records."""
    _remaining: int = 0
    _error: BaseException | None = None
    _reported: bool = False
    _done: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._remaining = self.chunks
        if self.chunks == 0:
            self._complete()

    def chunk_finished(
        self, error: BaseException | None, sums: torch.Tensor | None = None, first_extent: int = 0, count: int = 1
    ) -> None:
        """``count`` chunks are over (with ``error``, or adding ``sums`` from ``first_extent``)."""
        with self._lock:
            if error is not None and self._error is None:
                self._error = error
            if sums is not None and self.sums is not None:
                self.sums[first_extent : first_extent + sums.numel()] += sums
            self._remaining -= count
            last = self._remaining == 0
        if last:
            self._complete()

    def _complete(self) -> None:
        # The last chunk's thread records or checks the sums before anyone may use the
        # bytes: a read's wait() raises IntegrityError instead of returning.
        try:
            if self._error is None and self.finish is not None:
                self.finish(self)
        except BaseException as e:
            self._error = e
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> int:
        self._wait_done()
        if self._error is not None:
            self._reported = True
            raise self._error
        return self.nbytes

    def unreported_error(self) -> bool:
        """Whether the transfer failed and nobody has seen its error yet."""
        return self._error is not None and not self._reported

    def wait_unreported(self) -> None:
        """Like wait(), but an error some caller already saw is not raised twice."""
        self._wait_done()
        if self._error is not None and not self._reported:
            self.wait()

    def _wait_done(self) -> None:
        """Until every chunk is over, even when a signal's exception interrupts the wait:
        it is raised then (Note [interrupted waits] of ``greenroom.io.engine``)."""
        if self.timeline is not None and not self._done.is_set():
            start = time.perf_counter()
            try:
                self._wait_through()
            finally:
                self.timeline.add(SYNC, start, time.perf_counter())
        else:
            self._wait_through()

    def _wait_through(self) -> None:
        interrupted = None
        while not self._done.is_set():
            try:
                self._done.wait()
            except BaseException as e:
                interrupted = interrupted or e
        if interrupted is not None:
            raise interrupted
