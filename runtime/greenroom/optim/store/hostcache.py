"""The host cache of a ``BucketStore`` (``optim.store.held`` Note [host cache]).

``HostCache`` holds the cached buckets' bytes, which of them their files lag behind,
and the copies between them and a device buffer; ``host_memory`` hands out its
page-aligned anonymous memory, pinned for CUDA when asked; ``HostCopy`` is what
``BucketStore.stream`` waits on for a copy between a device buffer and that memory, as
it waits on the engine's ``Transfer`` for a file.
"""

from __future__ import annotations

import mmap
from typing import Iterable

import torch

from greenroom.errors import StorageError
from greenroom.io.fs import human_bytes
from greenroom.optim.store.layout import Bucket


class HostCopy:
    """A copy between a device buffer and the host cache, as ``stream`` waits for it
    (the engine's ``Transfer`` for a file). A read lets the caller's stream go on once
    the bytes are in; a write-back blocks the host until the device buffer is free."""

    __slots__ = ("event", "stream")

    def __init__(self, event=None, stream=None) -> None:
        self.event, self.stream = event, stream  # None: a synchronous (CPU) copy, already over

    def wait(self) -> None:
        if self.event is None:
            return
        if self.stream is not None:
            self.stream.wait_event(self.event)
        else:
            self.event.synchronize()


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as torch registers


def host_memory(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of page-aligned anonymous host memory as a uint8 tensor, registered with
    CUDA (pinned) when ``pin``. Not torch's pinned allocator, which rounds each
    allocation up to a power of two (a 2.4 GB bucket would take 4.3 GB); and not
    torch-owned, so actor offload on a CPU device leaves it in place, as it does the
    engine's own memory."""
    memory = mmap.mmap(-1, nbytes)
    tensor = torch.frombuffer(memory, dtype=torch.uint8)
    if pin:
        code = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE))
        if code != 0:
            raise StorageError(
                f"--stream-optimizer-state-host-cache-gb: pinning {human_bytes(nbytes)} of host memory "
                f"failed (CUDA error {code}); use a smaller host cache"
            )
    return tensor


def unpin(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


class HostCache:
    """Whole buckets in host memory, at most ``budget`` bytes of them (Note [host cache]
    of ``optim.store.held``), pinned when ``device`` is CUDA; a ``BucketStore`` owns one.

    ``tensors``: bucket index -> its bytes. ``stale``: the cached buckets whose file lags
    behind the cache."""

    def __init__(self, budget: int, device: torch.device) -> None:
        self.budget = budget
        self.device = device
        self.tensors: dict[int, torch.Tensor] = {}
        self.stale: set[int] = set()
        self.pinned = device.type == "cuda"
        self._copy_stream: torch.cuda.Stream | None = None

    def __contains__(self, index: int) -> bool:
        return index in self.tensors

    @property
    def nbytes(self) -> int:
        """Host memory the cached buckets take (at most ``budget``)."""
        return sum(t.numel() for t in self.tensors.values())

    def take(self, buckets: Iterable[Bucket]) -> None:
        """Give ``buckets`` host memory, in order, each while it still fits in what is
        left of the budget (Note [host cache])."""
        left = self.budget - self.nbytes
        for bucket in buckets:
            nbytes = bucket.data_bytes
            if nbytes <= left:
                self.tensors[bucket.index] = host_memory(nbytes, self.pinned)
                left -= nbytes

    def put(self, index: int, raw: torch.Tensor) -> None:
        """Copy a whole bucket's bytes into its host memory: its file goes stale."""
        self.tensors[index].copy_(raw)
        self.stale.add(index)

    def read(self, index: int, dst: torch.Tensor) -> HostCopy:
        """Start the copy of cached bucket ``index`` into ``dst`` (a device buffer)."""
        return self._copy(dst, self.tensors[index], to_device=True)

    def write(self, index: int, src: torch.Tensor) -> HostCopy:
        """Start the copy of ``src`` (a device buffer) into cached bucket ``index``: its
        file goes stale."""
        self.stale.add(index)
        return self._copy(self.tensors[index], src, to_device=False)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, *, to_device: bool) -> HostCopy:
        """Copy between a device buffer and the host cache: on the CPU at once; on CUDA on
        the cache's copy stream, after what the caller's stream has queued, so it runs
        beside the caller's update of the other buffer."""
        if not (dst.is_cuda or src.is_cuda):
            dst.copy_(src)
            return HostCopy()
        current = torch.cuda.current_stream(self.device)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        self._copy_stream.wait_stream(current)
        with torch.cuda.stream(self._copy_stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        # The caller's stream waits for a read on the device; a write-back's buffer is
        # reused by the engine, which only orders after the caller's stream: the host waits.
        return HostCopy(done, current if to_device else None)

    def sync(self) -> None:
        """Wait for every copy started."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()

    def free(self) -> None:
        """Give the host memory back (unpinned first): the cache holds nothing after."""
        if self.pinned:
            for host in self.tensors.values():
                unpin(host)
        self.tensors.clear()
        self.stale.clear()
