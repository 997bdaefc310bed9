"""The staging buffers of ``greenroom.io.engine.TransferEngine``: ``depth`` aligned host
buffers that together are the chunk, handed out one per chunk in flight."""

from __future__ import annotations

import queue

import torch

from greenroom.io.integrity import ALIGNMENT

DEFAULT_DEPTH = 4

STREAM_BUFFER_BYTES = 32 << 20
"""The smallest staging buffer ``stream_depth`` splits a chunk into."""

STREAM_MAX_DEPTH = 8


def stream_depth(chunk_bytes: int) -> int:
    """The staging depth of the optimizer-state stream: as many buffers as keep each at
    least ``STREAM_BUFFER_BYTES``, from ``DEFAULT_DEPTH`` up to ``STREAM_MAX_DEPTH`` (the
    default 256 MiB chunk: 8 of 32 MiB). A step reads ahead and writes behind through
    one engine, so its reads and writes share the buffers; with 8 the disk kept 8.3
    requests in flight against 6.1 with 4 and the step ran 3-6 % faster (docs/benchmarks.md,
    'Design measurements'). Smaller chunks keep 4, whose buffers hold whole frames down to
    ``codec_names.MIN_COMPRESSED_CHUNK_MB``."""
    return max(DEFAULT_DEPTH, min(STREAM_MAX_DEPTH, chunk_bytes // STREAM_BUFFER_BYTES))


def _aligned_backing(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of host memory with room to start at an ``ALIGNMENT`` boundary.

    Pinned, the exact size first: torch's pinned allocator rounds each block up to a power
    of two, so the 4 KiB of slack a misaligned start would need made a 256 MiB staging pin
    512 MiB (``pinned_host`` in ``bench stream``; docs/benchmarks.md, 'Design
    measurements'). Its blocks of a power-of-two size start on a page; the slack is only
    added where one did not."""
    if pin:
        exact = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if exact.data_ptr() % ALIGNMENT == 0:
            return exact
        del exact
    return torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=pin)


class StagingBuffers:
    """``depth`` aligned host buffers whose sizes add up to at most ``total_bytes``.

    Pinned when CUDA is available, so device copies are true DMA and can overlap.
    """

    def __init__(self, total_bytes: int, depth: int = DEFAULT_DEPTH, *, pin: bool | None = None) -> None:
        if pin is None:
            pin = torch.cuda.is_available()
        each = max(ALIGNMENT, total_bytes // depth // ALIGNMENT * ALIGNMENT)
        self.buffer_bytes = each
        self.pinned = pin
        backing = _aligned_backing(each * depth, pin)
        skew = (-backing.data_ptr()) % ALIGNMENT
        self._backing = backing
        self.buffers = [backing[skew + i * each : skew + (i + 1) * each] for i in range(depth)]
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(depth):
            self._free.put(i)

    def touch(self) -> None:
        """Write every page of the buffers once. Unpinned memory is only mapped on its
        first write, and the first transfer through untouched buffers takes those page
        faults inside its own time (``DiskMover.prepare`` takes them before the first
        sleep); pinned memory is mapped already, and this costs one memset."""
        self._backing.zero_()

    @property
    def total_bytes(self) -> int:
        return self.buffer_bytes * len(self.buffers)

    def owned(self) -> list[torch.Tensor]:
        """The host memory these buffers hold (``HostMover.owned``'s counterpart): what a
        scan for the actor's tensors must leave alone."""
        return [self._backing]

    def acquire(self) -> int:
        return self._free.get()

    def release(self, index: int) -> None:
        self._free.put(index)
