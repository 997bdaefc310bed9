"""The actor's sleep/wake pair, and the portable backend.

An ``Offloader`` is told what the actor holds (``track``), then ``sleep()`` moves all of
it off the device and gives the memory back, and ``wake()`` brings it back bit-identical.
``with offloader.asleep(): ...`` makes the phase boundary explicit: whatever runs in the
block (the rollout) has the memory the actor gave back.

The portable backend (this module) runs anywhere torch runs: it copies each tracked
storage out (``HostMover`` or ``DiskMover``), then shrinks the storage to zero bytes so
the allocator gets the memory back; wake re-grows the storage and copies the bytes in.
Tensor objects, views and the optimizer's references stay valid across the cycle; on
CUDA only torch_memory_saver (``greenroom.actor.tms``) also keeps the device addresses.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass

import torch

from greenroom.actor import tracking
from greenroom.actor.movers import DiskMover, HostMover


@dataclass(kw_only=True, slots=True)
class PhaseStats:
    """What one sleep or wake did."""

    seconds: float
    """Wall time of the transition, device synchronised."""

    nbytes: int
    """Bytes of actor state moved."""

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else 0.0


class Offloader:
    """Base: tracking, the phase helper and statistics. On its own it keeps the actor
    resident (``--offload-train`` off: sleep and wake move nothing); backends override
    ``_sleep`` and ``_wake`` and may override ``rollout_region``."""

    backend = "none"

    def __init__(self, *, target: str, device: torch.device | str = "cpu") -> None:
        self.target = target
        self.device = torch.device(device)
        self._sources: list = []
        self._asleep: list[tracking.Tracked] | None = None
        self.last_sleep: PhaseStats | None = None
        self.last_wake: PhaseStats | None = None

    def track(self, *sources) -> "Offloader":
        """Add what the actor holds: modules (params, grads, buffers), optimizers
        (their resident state) or tensors. Read again at every sleep, so state that
        appears later (grads, Adam moments after the first step) is included."""
        self._sources.extend(sources)
        return self

    @property
    def is_asleep(self) -> bool:
        return self._asleep is not None

    def tracked(self) -> list[tracking.Tracked]:
        return [t for t in tracking.collect(self._sources) if t.device.type == self.device.type]

    def resident_bytes(self) -> int:
        """Device bytes the actor's tracked state occupies now (0 while asleep)."""
        return 0 if self.is_asleep else sum(t.nbytes for t in self.tracked())

    def sleep(self) -> PhaseStats:
        assert not self.is_asleep, "sleep() twice without wake()"
        start = time.perf_counter()
        self._synchronize()
        tracked = self.tracked() if self.backend != "none" else []
        self._sleep(tracked)
        self._synchronize()
        self._asleep = tracked
        self.last_sleep = PhaseStats(seconds=time.perf_counter() - start, nbytes=sum(t.nbytes for t in tracked))
        return self.last_sleep

    def wake(self) -> PhaseStats:
        assert self.is_asleep, "wake() without sleep()"
        start = time.perf_counter()
        tracked, self._asleep = self._asleep, None
        self._wake(tracked)
        self._synchronize()
        self.last_wake = PhaseStats(seconds=time.perf_counter() - start, nbytes=sum(t.nbytes for t in tracked))
        return self.last_wake

    @contextlib.contextmanager
    def asleep(self):
        """Sleep on entry, wake on exit (also when the block raises)."""
        self.sleep()
        try:
            yield self
        finally:
            self.wake()

    def rollout_region(self) -> contextlib.AbstractContextManager:
        """Where allocations of the rollout (the engine's weights, its KV cache) must
        happen so that they never land in memory the sleeping actor owns."""
        return contextlib.nullcontext()

    @property
    def host_bytes(self) -> int:
        """Host memory this offloader holds (staging or host copies)."""
        return 0

    def close(self) -> None:
        """Release files and host copies. Closing while asleep discards the sleeping
        state (the process is going away: reading it back would only cost time)."""
        self._asleep = None

    def __enter__(self) -> "Offloader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _sleep(self, tracked: list[tracking.Tracked]) -> None:
        pass

    def _wake(self, tracked: list[tracking.Tracked]) -> None:
        pass


class PortableOffloader(Offloader):
    """Copies tracked storages out, then frees them by resizing them to zero bytes."""

    backend = "portable"

    def __init__(self, *, target: str, device: torch.device | str = "cpu", offload_dir: str | None = None,
                 chunk_bytes: int = 256 << 20) -> None:
        super().__init__(target=target, device=device)
        if target == "disk":
            assert offload_dir is not None, "the disk target needs the rank's offload dir"
            self._mover = DiskMover(offload_dir, chunk_bytes)
        else:
            self._mover = HostMover()
        self._warned = False

    def _sleep(self, tracked: list[tracking.Tracked]) -> None:
        self._mover.save(tracked)
        pinned = [t for t in tracked if not t.storage.resizable()]
        if pinned and not self._warned:
            # A storage torch does not own (from_blob, numpy, some loaders) cannot be
            # shrunk: it is still saved and restored, but stays resident.
            warnings.warn(f"actor offload: {len(pinned)} storages ({sum(t.nbytes for t in pinned)} bytes) are "
                          "not resizable and stay resident while the actor sleeps")
            self._warned = True
        for t in tracked:
            if t.storage.resizable():
                t.storage.resize_(0)

    def _wake(self, tracked: list[tracking.Tracked]) -> None:
        for t in tracked:
            if t.storage.nbytes() != t.nbytes:
                t.storage.resize_(t.nbytes)
        self._mover.restore(tracked)

    @property
    def host_bytes(self) -> int:
        return self._mover.host_bytes

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._mover.close()
