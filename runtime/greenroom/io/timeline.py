"""``Timeline``: where an engine's time went, recorded as intervals and summed over a window.

A bench switches one on (``TransferEngine.record``); the engine's threads then record each
disk read or write, codec call, device copy or its wait, host copy and checksum as one
``(kind, start, end)`` interval of ``time.perf_counter``, and a caller's wait on a transfer
as ``sync``. Off (None, the default) nothing is recorded: training pays nothing.

Note [where the time went]: ``summary(t0, t1)`` splits a window's wall time into the disk's
busy time (at least one read or write in flight: the union of the ``disk`` intervals) and
its idle time, and gives every instant of the idle time to one kind: the first of
``IDLE_ORDER`` that was active then, else ``other`` (nothing recorded: the caller's own
work, such as the optimizer's arithmetic). The parts of the idle time are exclusive and
sum to it, so the largest is what kept the disk waiting most. The order puts the engine's
own work before ``sync``: a caller blocked on a transfer while the codec runs waits for the
codec; ``sync`` keeps only the waits with neither disk I/O nor recorded work under them
(thread hand-offs, a chunk waiting its turn). Each kind's own busy time (the union of its
intervals in the window, overlapping the disk or not) is reported beside it.

A disk busy all the time can still be slower than the raw probe: ``disk_depth`` is the
mean number of reads and writes in flight while it was busy (the disk intervals' summed
length over their union), the figure to hold against the probe's requests in flight.
"""

from __future__ import annotations

import threading
import time

DISK = "disk"
CODEC = "codec"
DEVICE_COPY = "device_copy"
HOST = "host"
SYNC = "sync"
OTHER = "other"

IDLE_ORDER = (CODEC, DEVICE_COPY, HOST, SYNC)
"""Who gets an instant of the disk's idle time when several were active (Note [where the time went])."""

KINDS = (DISK, *IDLE_ORDER)

WORDS = {
    CODEC: "the codec",
    DEVICE_COPY: "device copies",
    HOST: "host CPU (checksums, host copies)",
    SYNC: "waits on transfers",
    OTHER: "nothing recorded (the caller's own work)",
}
"""How a text report names each part of the disk's idle time."""


class _Span:
    __slots__ = ("_timeline", "_kind", "_start")

    def __init__(self, timeline: Timeline, kind: str) -> None:
        self._timeline = timeline
        self._kind = kind

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self._timeline.add(self._kind, self._start, time.perf_counter())


class _NoSpan:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


_NO_SPAN = _NoSpan()


def span(timeline: Timeline | None, kind: str):
    """``with span(timeline, kind):`` records the block as one interval; nothing when
    ``timeline`` is None."""
    return _NO_SPAN if timeline is None else _Span(timeline, kind)


class Timeline:
    """Intervals of named kinds (``KINDS``), appended from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[tuple[str, float, float]] = []

    def add(self, kind: str, start: float, end: float) -> None:
        assert kind in KINDS, kind
        with self._lock:
            self._spans.append((kind, start, end))

    def clear(self) -> None:
        """Forget every interval recorded so far (one still open is added when it ends)."""
        with self._lock:
            self._spans = []

    def summary(self, t0: float, t1: float) -> dict:
        """The window ``[t0, t1]`` split as Note [where the time went] says: seconds and
        fractions of the wall time, and ``largest``, the part of the idle time that is the
        largest (None when the disk never idled)."""
        with self._lock:
            spans = list(self._spans)
        return summarize(spans, t0, t1)


def summarize(spans, t0: float, t1: float) -> dict:
    """``Timeline.summary`` of the intervals ``spans`` (``(kind, start, end)``)."""
    wall = max(t1 - t0, 0.0)
    unions = {kind: _union([(s, e) for k, s, e in spans if k == kind], t0, t1) for kind in KINDS}
    events = sorted({t0, t1, *(x for intervals in unions.values() for pair in intervals for x in pair)})
    idle = dict.fromkeys((*IDLE_ORDER, OTHER), 0.0)
    busy = 0.0
    cursors = dict.fromkeys(KINDS, 0)
    for a, b in zip(events, events[1:]):
        active = set()
        for kind, intervals in unions.items():
            i = cursors[kind]
            while i < len(intervals) and intervals[i][1] <= a:
                i += 1
            cursors[kind] = i
            if i < len(intervals) and intervals[i][0] <= a:
                active.add(kind)
        if DISK in active:
            busy += b - a
        else:
            idle[next((k for k in IDLE_ORDER if k in active), OTHER)] += b - a
    idle_total = sum(idle.values())
    disk_spans = sum(min(e, t1) - max(s, t0) for k, s, e in spans if k == DISK and min(e, t1) > max(s, t0))

    def fraction(seconds: float) -> float:
        return min(max(seconds / wall, 0.0), 1.0) if wall else 0.0

    parts = {
        kind: {
            "idle_s": idle[kind],
            "idle_fraction": fraction(idle[kind]),
            "busy_s": None if kind == OTHER else sum((e - s for s, e in unions[kind]), 0.0),
        }
        for kind in idle
    }
    largest = max(idle, key=lambda k: idle[k]) if idle_total > 0 else None
    return {
        "wall_s": wall,
        "disk_busy_s": busy,
        "disk_busy_fraction": fraction(busy),
        "disk_depth": disk_spans / busy if busy else None,
        "disk_idle_s": idle_total,
        "disk_idle_fraction": fraction(idle_total),
        "parts": parts,
        "largest": largest,
    }


def _union(intervals, t0: float, t1: float) -> list[tuple[float, float]]:
    """The intervals clipped to ``[t0, t1]``, sorted and merged where they touch."""
    merged: list[list[float]] = []
    for s, e in sorted((max(s, t0), min(e, t1)) for s, e in intervals):
        if e <= s:
            continue
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]
