"""Memory accounting for the offload phases: host RSS (sampled, with a peak) and the
device memory in use as the driver sees it (which, unlike torch's allocator counters,
knows about memory torch_memory_saver has unmapped)."""

from __future__ import annotations

import threading

import psutil
import torch


class RssSampler:
    """Samples this process's RSS every ``interval`` seconds in a daemon thread."""

    def __init__(self, interval: float = 0.005) -> None:
        self._process = psutil.Process()
        self._interval = interval
        self._peak = self.rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="greenroom-rss", daemon=True)
        self._thread.start()

    def rss(self) -> int:
        return self._process.memory_info().rss

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._peak = max(self._peak, self.rss())

    def reset_peak(self) -> int:
        """Return the peak since the last reset and start a new window."""
        peak = max(self._peak, self.rss())
        self._peak = self.rss()
        return peak

    @property
    def peak(self) -> int:
        return max(self._peak, self.rss())

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def device_used_bytes(device: torch.device) -> int | None:
    """Device memory in use on ``device`` (all processes), None without CUDA."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free
