"""The nvCOMP decoders an engine keeps between the chunks it reads
(``greenroom.io.nvcomp_codec``).

Note [kept decoders]: nvCOMP's decoders are kept from chunk to chunk while the engine has
reads that decode on the device in flight, one set per device on one decode stream, and
dropped when the last of those reads ends. A decoder made per call cost the decode most of
its time, and a wake about twice the CPU time (docs/benchmarks.md, 'Design measurements').
One stream and one set per device bound the kept scratch to two decoders (one per coding:
Note [16-bit frames] of ``greenroom.io.nvcomp_codec``) whatever the number of I/O threads, and
lose nothing, since nvCOMP calls run one at a time anyway. Dropped when no read needs them,
their scratch is back in torch's cache before a step ends or an actor sleeps.
"""

from __future__ import annotations

import contextlib
import threading

import torch


class KeptDecoders:
    """Each device's decode stream and nvCOMP decoders, kept while any read that decodes
    there is in flight (Note [kept decoders])."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reads = 0
        self._by_device: dict[torch.device, tuple[torch.cuda.Stream, dict]] = {}

    @contextlib.contextmanager
    def reading(self):
        """Around one chunk's read and decode: the last to leave drops every decoder."""
        with self._lock:
            self._reads += 1
        try:
            yield
        finally:
            with self._lock:
                self._reads -= 1
                if not self._reads:
                    self._by_device.clear()

    def on(self, device: torch.device) -> tuple[torch.cuda.Stream, dict]:
        """The decode stream of ``device`` and the decoders bound to it (inside ``reading``)."""
        with self._lock:
            if device not in self._by_device:
                self._by_device[device] = (torch.cuda.Stream(device), {})
            return self._by_device[device]

    def held(self) -> int:
        """Devices with decoders kept now (0 whenever no read is in flight)."""
        with self._lock:
            return len(self._by_device)
