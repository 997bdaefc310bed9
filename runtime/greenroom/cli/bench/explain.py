"""Where a bench's time went: the breakdown of ``greenroom.io.timeline`` judged against a
bound, and the one line a text report prints for it.

``bench stream`` gives each step, and ``bench offload`` each sleep and each wake, a
``breakdown`` (``Timeline.summary`` over its seconds: the disk's busy fraction and each
kind's share of the disk's idle time) and a ratio to the bound of its own stored bytes. A
phase more than ``OVER`` above its bound names the largest part of the disk's idle time
in its line and carries that line as ``explanation`` in the JSON. The time over the bound
is the disk's idle time plus its busy time beyond the bound (the disk itself running
below the probe's rate); where that second share is larger than any part of the idle
time, the line names it, with the mean number of requests the disk had in flight
(``disk_depth``) beside the probe's.
"""

from __future__ import annotations

from greenroom.cli.bench.disk import RAW_THREADS
from greenroom.io.timeline import IDLE_ORDER, OTHER, WORDS

OVER = 1.05
"""A phase above this ratio to its stored-bytes bound missed it and says why."""


def explanation(name: str, breakdown: dict | None, ratio: float | None, bound: str) -> str | None:
    """The line of a phase that missed its bound (``ratio`` over ``OVER``), naming the
    largest share of the disk's idle time; None where it did not miss or nothing was recorded."""
    if breakdown is None or ratio is None or ratio <= OVER:
        return None
    head = f"{name} took {ratio:.2f}x {bound}: the disk was busy {breakdown['disk_busy_fraction']:.0%} of it"
    slow = breakdown["disk_busy_fraction"] - 1 / ratio  # busy beyond the bound, a share of the wall time
    largest = breakdown["largest"]
    part = breakdown["parts"][largest] if largest is not None else None
    if part is None or slow > part["idle_fraction"]:
        depth = breakdown.get("disk_depth")
        in_flight = f" with {depth:.1f} requests in flight on average" if depth else ""
        return (
            f"{head}{in_flight} (the raw probe keeps {RAW_THREADS}): the disk itself ran below the probe's rate, "
            f"busy {slow:.0%} of the time beyond the bound; {_parts(breakdown)}"
        )
    return (
        f"{head}; the largest share of the rest was {WORDS[largest]}, {part['idle_fraction']:.0%} of the time "
        f"({part['idle_s']:.3f} s); {_parts(breakdown)}"
    )


def line(name: str, breakdown: dict | None, ratio: float | None, bound: str) -> str | None:
    """The text report's line for one phase: its ``explanation`` where it missed, else where
    its time went; None where nothing was recorded."""
    if breakdown is None:
        return None
    missed = explanation(name, breakdown, ratio, bound)
    if missed is not None:
        return missed
    against = f" ({ratio:.2f}x {bound})" if ratio is not None else ""
    return f"{name}{against}: the disk was busy {breakdown['disk_busy_fraction']:.0%} of it; {_parts(breakdown)}"


def _parts(breakdown: dict) -> str:
    parts = breakdown["parts"]
    return "while it idled: " + ", ".join(
        f"{WORDS[kind]} {parts[kind]['idle_fraction']:.0%}" for kind in (*IDLE_ORDER, OTHER)
    )


def judge_steps(steps: list[dict], mixed_read_bytes_per_s: float, mixed_write_bytes_per_s: float) -> None:
    """Give each step of ``bench stream`` its own ``overlapped_ratio`` (its seconds over the
    larger of its stored bytes read at the mixed read rate and written at the mixed write
    rate; None where it moved nothing or there is no mixed probe) and its ``explanation``."""
    for i, s in enumerate(steps, 1):
        bound = (
            max(s["disk_bytes_read"] / mixed_read_bytes_per_s, s["disk_bytes_written"] / mixed_write_bytes_per_s)
            if mixed_read_bytes_per_s and mixed_write_bytes_per_s
            else 0
        )
        s["overlapped_ratio"] = s["seconds"] / bound if bound else None
        s["explanation"] = explanation(
            f"step {i}", s["breakdown"], s["overlapped_ratio"], "the overlapped bound of its stored bytes"
        )
