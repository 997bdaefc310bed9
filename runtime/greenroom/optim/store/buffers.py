"""The device buffers of a ``BucketStore``: ``DEVICE_BUFFERS`` of one bucket file each
(``BucketStore.stream`` says what each does), made when a stream or a fill first needs
them and given back by ``release_device_buffers``.
"""

from __future__ import annotations

from typing import Callable

import torch

from greenroom.optim.store.files import Replacement


class DeviceBuffer:
    """A device buffer holding one bucket file's bytes, the write still reading it, and
    the new file that write fills, to be installed once it is over (``optim.store.files`` Note [new inodes])."""

    __slots__ = ("raw", "write", "replacing", "link_out")

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.write = None
        self.replacing: Replacement | None = None
        self.link_out: int | None = None  # a bucket written in place, for the checkpoint to link once written


class DeviceBuffers:
    """The device buffers of a ``BucketStore``, which owns one: each ``nbytes()`` long
    (the largest bucket's, asked when a buffer is made), on ``device``."""

    def __init__(self, nbytes: Callable[[], int], device: torch.device) -> None:
        self._nbytes = nbytes
        self._device = device
        self._buffers: list[DeviceBuffer] = []

    def get(self, i: int) -> DeviceBuffer:
        """Buffer ``i``, made (with those before it) where it is missing."""
        while len(self._buffers) <= i:
            self._buffers.append(DeviceBuffer(self._nbytes(), self._device))
        return self._buffers[i]

    def ring(self, count: int, first: DeviceBuffer | None) -> list[DeviceBuffer]:
        """``count`` distinct device buffers for a stream, ``first`` (the kept bucket's) leading."""
        ring = [] if first is None else [first]
        i = 0
        while len(ring) < count:
            if self.get(i) is not first:
                ring.append(self.get(i))
            i += 1
        return ring

    @property
    def nbytes(self) -> int:
        """Device memory the buffers take."""
        return sum(s.raw.numel() for s in self._buffers)

    def release(self) -> None:
        """Give the buffers back (made again when next needed)."""
        self._buffers.clear()
