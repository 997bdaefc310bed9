"""How much anonymous host memory a block of code takes at its peak.

The page cache (what a file-backed map reads) is the kernel's to reclaim; anonymous memory
(the heap, a tensor's clone) is not. ``PeakAnon`` samples this process's ``RssAnon``
(``/proc/self/status``) every half millisecond while its block runs and keeps the largest
growth over the value it started from: a copy that lives until the block ends (a save's
clones of the state it writes) is seen whole; one shorter than a sample may be missed.
"""

from __future__ import annotations

import threading

SAMPLE_S = 0.0005


def anon_bytes() -> int:
    """This process's resident anonymous memory, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


class PeakAnon:
    """``with PeakAnon() as p: ...`` then ``p.peak``: the block's largest growth of
    anonymous memory, in bytes."""

    def __enter__(self) -> PeakAnon:
        self.base, self.peak, self._done = anon_bytes(), 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, name="greenroom-peak-anon", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(SAMPLE_S):
            self.peak = max(self.peak, anon_bytes() - self.base)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, anon_bytes() - self.base)
