"""SIGTERM and SIGINT held across a section that must not stop half-way.

A rank dir's open and close, and the trainer's wait for an ``--async-save`` publish,
hold the two signals: while held they are only recorded; at the end the handlers come
back and each signal that came has the effect it would have had then (dirs/rankdir.py's
Note [an interrupted close] says why). Off the main thread no handler can be set, so
nothing is held there.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

HELD = (signal.SIGTERM, signal.SIGINT)


def hold(received: list[int]) -> dict[int, object]:
    """From now on SIGTERM and SIGINT only append to ``received``; returns the handlers
    they had, for ``put_back`` and ``deliver`` (none off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    found: dict[int, object] = {}
    for signum in HELD:
        found[signum] = signal.signal(signum, lambda signum, _frame: received.append(signum))
    return found


def put_back(found: dict[int, object]) -> None:
    for signum, handler in found.items():
        signal.signal(signum, handler)


def deliver(found: dict[int, object], received: list[int]) -> None:
    """Have each signal held meanwhile do what it would have done when it came: call the
    handler it had then (a rank dir's ``raise_exit`` raises SystemExit or KeyboardInterrupt)."""
    for signum in dict.fromkeys(received):
        handler = found[signum]
        if callable(handler):
            handler(signum, None)
        elif handler == signal.SIG_DFL:
            signal.raise_signal(signum)  # its handler is back: the process ends by it, as then


@contextlib.contextmanager
def signals_held():
    """SIGTERM and SIGINT that come during the block have their effect at its end,
    through the handlers they had at its start. Yields the list they are recorded in, so
    that a block can end early on them."""
    received: list[int] = []
    found = hold(received)
    try:
        yield received
    finally:
        put_back(found)
        deliver(found, received)


def raise_exit(signum, _frame) -> None:
    """The handler a rank dir installs: the signal becomes an exception, so that ``with``
    blocks and ``finally`` clauses run on the way out."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    sys.exit(128 + signum)
