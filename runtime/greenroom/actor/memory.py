"""Memory accounting for the offload phases: host RSS (sampled, with a peak) and the
device memory in use as the driver sees it (which, unlike torch's allocator counters,
knows about memory torch_memory_saver has unmapped)."""

from __future__ import annotations

import threading

import psutil
import torch


def page_cache_bytes() -> int:
    """The kernel's page cache (``Cached`` of /proc/meminfo), machine-wide."""
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no Cached line")


class RssSampler:
    """Samples this process's RSS every ``interval`` seconds in a daemon thread: its peak
    (``peak``, windows with ``reset_peak``), the peak of its anonymous part
    (``anon_peak``: RSS less file-backed pages, which the kernel can drop) and, with
    ``page_cache=True``, the machine's page cache (``cached_before``, ``cached_peak``).
    A context manager too: the sampling stops at exit, after a last sample."""

    def __init__(self, interval: float = 0.005, *, page_cache: bool = False) -> None:
        self._process = psutil.Process()
        self._interval = interval
        self._page_cache = page_cache
        info = self._process.memory_info()
        self._peak = info.rss
        self.anon_peak = info.rss - info.shared
        self.cached_before = self.cached_peak = page_cache_bytes() if page_cache else 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="greenroom-rss", daemon=True)
        self._thread.start()

    def rss(self) -> int:
        return self._process.memory_info().rss

    def _sample(self) -> None:
        info = self._process.memory_info()
        self._peak = max(self._peak, info.rss)
        self.anon_peak = max(self.anon_peak, info.rss - info.shared)
        if self._page_cache:
            self.cached_peak = max(self.cached_peak, page_cache_bytes())

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def reset_peak(self) -> int:
        """Return the peak since the last reset and start a new window."""
        peak = max(self._peak, self.rss())
        self._peak = self.rss()
        return peak

    @property
    def peak(self) -> int:
        return max(self._peak, self.rss())

    def close(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self._sample()

    def __enter__(self) -> "RssSampler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def device_used_bytes(device: torch.device) -> int | None:
    """Device memory in use on ``device`` (all processes), None without CUDA."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free
