"""The actor's sleep/wake pair, and the portable backend.

``sleep()`` moves every live allocation of the actor off the device and gives the
memory back; ``wake()`` brings it back bit-identical. The trainer does not have to list
anything: each backend finds what is live (``greenroom.actor.discovery``). ``track()``
is a hint (those storages come first in the file) and ``discard()`` declares bytes the
next sleep may drop. ``with offloader.asleep(): ...`` makes the phase boundary explicit:
whatever runs in the block (the rollout) has the memory the actor gave back.

The portable backend (this module) runs anywhere torch runs: it copies each live storage
out (``HostMover`` or ``DiskMover``), then shrinks it to zero bytes and, on CUDA, empties
torch's cache so the driver gets the memory back; wake re-grows each storage and copies
the bytes in. The tensor objects themselves stay (a param, its grad, the optimizer's
references to them, views); only device addresses may change. On CUDA,
torch_memory_saver (``greenroom.actor.tms``) also keeps the addresses.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from greenroom.actor import discovery, tracking
from greenroom.actor.liveness import Liveness
from greenroom.actor.movers import DiskMover, HostMover, Moved
from greenroom.errors import ConfigError, GreenroomError
from greenroom.io.timeline import Timeline
from greenroom.log import get_logger

SCOPES = ("all", "tracked")
log = get_logger(__name__)


class LeftAsleep(GreenroomError):
    """A sleep that failed after the device memory was given back, and whose undo (a
    wake) failed too: the actor is asleep, its copies whole, and ``wake()`` retries."""


@dataclass(kw_only=True, slots=True)
class PhaseStats:
    """What one sleep or wake did."""

    seconds: float
    """Wall time of the transition, device synchronised."""

    nbytes: int
    """Bytes of the actor's live memory the transition covered (moved, skipped as
    unchanged, or dropped as dead)."""

    copied: int = 0
    """Bytes actually written out (sleep) or read back (wake)."""

    clean: int = 0
    """Bytes not rewritten: the target already held them (sleep only)."""

    dead: int = 0
    """Bytes dropped at sleep and zero-filled at wake (consumed grads, discards, units
    that were all zeros)."""

    left_resident: int = 0
    """Bytes the sleep found but left on the device as they are, intact, and not counted
    in ``nbytes`` (portable backend): storages torch does not own (numpy, ``from_blob``),
    which cannot be shrunk, and storages in shared memory (``share_memory_()``, a
    DataLoader worker's batch), which other processes may use (sleep only)."""

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds if self.seconds > 0 else 0.0


@dataclass(kw_only=True, slots=True)
class Prepared:
    """What ``Offloader.prepare`` did."""

    seconds: float
    """Wall time of the call, device synchronised."""

    nbytes: int
    """Bytes of the actor's live memory the next sleep would move as it stands now."""

    written: int = 0
    """Bytes written to ready the target (zeros over the offload file's new part)."""


def drop_zeros(units: list[tracking.Tracked]) -> None:
    """Mark units whose bytes are all zero as dead: zero-filling them at wake gives the
    same bytes, so nothing needs to move (grads zeroed in place after the step, fresh
    buffers). One reduction per unit where it lives, one synchronisation per device."""
    by_device: dict[torch.device, list[tracking.Tracked]] = {}
    for u in units:
        if not u.dead:
            by_device.setdefault(u.device, []).append(u)
    for group in by_device.values():
        nonzero = torch.stack([u.bytes_view().any() for u in group]).tolist()
        for u, keep in zip(group, nonzero):
            u.dead = not keep


class Offloader:
    """Base: hints, the phase helper and statistics. On its own it keeps the actor
    resident (``--offload-train`` off: sleep and wake move nothing); backends override
    ``_units``, ``_sleep`` and ``_wake`` and may override ``rollout_region``.

    ``scope``: ``all`` (default) moves every live allocation the backend can find;
    ``tracked`` only what ``track()`` named (an opt-in fast path: anything else the
    actor keeps across the phase is then the trainer's business).
    """

    backend = "none"

    def __init__(self, *, target: str, device: torch.device | str = "cpu", scope: str = "all") -> None:
        if scope not in SCOPES:
            raise ConfigError(f"offload scope: expected one of {', '.join(SCOPES)}, got {scope!r}")
        self.target = target
        self.device = torch.device(device)
        self.scope = scope
        self._sources: list = []
        self._asleep: list[tracking.Tracked] | None = None
        self.liveness = Liveness() if self.backend != "none" else None
        self.last_sleep: PhaseStats | None = None
        self.last_wake: PhaseStats | None = None
        self._left_resident = 0  # bytes the last _units() found but leaves on the device
        self._failed_sleep: str | None = None  # the first line of the last sleep's error, if it failed
        self.state_dir = None  # the claimed offload dir (greenroom.dirs.statedir), released after the files close

    def track(self, *sources) -> "Offloader":
        """Name what the actor holds: modules (params, grads, buffers), optimizers
        (their resident state) or tensors. A hint: with scope ``all`` everything live
        moves anyway. Read again at every sleep."""
        self._sources.extend(sources)
        return self

    def discard(self, *tensors: torch.Tensor) -> "Offloader":
        """The next sleep may drop these tensors' bytes: they come back zero-filled.
        Each must cover its whole storage."""
        if self.liveness is not None:
            self.liveness.discard(tensors)
        return self

    @property
    def is_asleep(self) -> bool:
        return self._asleep is not None

    def tracked(self) -> list[tracking.Tracked]:
        return [t for t in tracking.collect(self._sources) if t.device.type == self.device.type]

    def resident_bytes(self) -> int:
        """Device bytes the actor's tracked state occupies now (0 while asleep)."""
        return 0 if self.is_asleep else sum(t.nbytes for t in self.tracked())

    def prepare(self) -> Prepared:
        """Ready the target for the next sleep outside it: on the disk target the offload
        file is made (or grown) for what the actor holds now, space refused in one line if
        the disk lacks it, and its new part written once with zeros, so the sleep does not
        pay the disk's first touch of its blocks (Note [backed blocks] of
        ``greenroom.io.statefile``). Optional: a sleep without it makes the file itself.
        What the actor allocates after this call (an optimizer's state at its first step)
        grows the file at the sleep that first finds it. Awake only."""
        if self.is_asleep:
            raise GreenroomError("actor offload: prepare() while asleep: call wake() first")
        start = time.perf_counter()
        self._synchronize()
        units = self._units() if self.backend != "none" else []
        written = self._prepare(units)
        self._synchronize()
        live = sum(u.nbytes for u in units if not u.dead)
        return Prepared(seconds=time.perf_counter() - start, nbytes=live, written=written)

    def sleep(self) -> PhaseStats:
        if self.is_asleep:  # an error, not an assert: misuse must fail under python -O too
            raise GreenroomError("actor offload: sleep() while asleep: call wake() first")
        start = time.perf_counter()
        self._synchronize()
        for source in self._sources:
            # A tracked optimizer that streams gives back its buffers itself (the bucket
            # files already hold what they held): nothing to move for them.
            release = getattr(source, "release_device_memory", None)
            if callable(release):
                release()
        units = self._units() if self.backend != "none" else []
        try:
            moved = self._sleep(units)
        except LeftAsleep:
            self._asleep = units  # wake() brings it back (or tries again)
            raise
        except BaseException as e:
            # Nothing was given back yet (the device copy goes only after every byte is
            # written and synced), or the backend put it back: the sleep is undone, the
            # actor stays awake as it was.
            self._failed_sleep = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise
        self._failed_sleep = None
        self._synchronize()
        self._asleep = units
        self.last_sleep = self._stats(start, units, moved, left_resident=self._left_resident)
        return self.last_sleep

    def wake(self) -> PhaseStats:
        """Bring everything back. If it fails (an I/O error, no device memory yet), the
        offloader stays asleep with its copies intact and ``wake()`` can be tried again."""
        if not self.is_asleep:
            if self._failed_sleep is not None:
                raise GreenroomError(
                    f"actor offload: wake() after a failed sleep: nothing to wake, the sleep was "
                    f"undone and every tensor is still on the device as it was (the sleep failed "
                    f"with: {self._failed_sleep})"
                )
            raise GreenroomError("actor offload: wake() while awake: call sleep() first")
        start = time.perf_counter()
        units = self._asleep
        moved = self._wake(units)
        self._synchronize()
        self._asleep = None
        if self.liveness is not None:
            self.liveness.woke()
        self.last_wake = self._stats(start, units, moved)
        return self.last_wake

    @staticmethod
    def _stats(start: float, units: list[tracking.Tracked], moved: Moved | None, left_resident: int = 0) -> PhaseStats:
        moved = moved or Moved()
        return PhaseStats(
            seconds=time.perf_counter() - start,
            nbytes=sum(u.nbytes for u in units),
            copied=moved.copied,
            clean=moved.clean,
            dead=moved.dead,
            left_resident=left_resident,
        )

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
        happen: they are not the actor's, never move, and never land in memory the
        sleeping actor owns."""
        return contextlib.nullcontext()

    def outside_region(self) -> contextlib.AbstractContextManager:
        """Where memory that must never be paused is allocated (on torch_memory_saver:
        outside its region; elsewhere nothing is paused, so a no-op)."""
        return contextlib.nullcontext()

    @property
    def host_bytes(self) -> int:
        """Host memory this offloader holds (staging or host copies)."""
        return 0

    def disk_bytes(self, way: str) -> int:
        """Bytes ``written`` to or ``read`` from the disk so far (the disk target; below
        the bytes moved where frames were compressed)."""
        return 0

    def record(self, timeline: Timeline | None) -> bool:
        """Record where the disk mover's time goes into ``timeline`` (``greenroom.io.timeline``;
        None stops it). False where nothing is recorded: a host target, torch_memory_saver's
        own mover."""
        return False

    def close(self) -> None:
        """Release files and host copies. Closing while asleep discards the sleeping
        state (the process is going away: reading it back would only cost time)."""
        self._asleep = None
        if self.liveness is not None:
            self.liveness.close()
            self.liveness = None

    def _release_dir(self) -> None:
        if self.state_dir is not None:
            state_dir, self.state_dir = self.state_dir, None
            state_dir.release()

    def __enter__(self) -> "Offloader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _units(self) -> list[tracking.Tracked]:
        return []

    def _prepare(self, units: list[tracking.Tracked]) -> int:
        return 0

    def _sleep(self, units: list[tracking.Tracked]) -> Moved | None:
        return None

    def _wake(self, units: list[tracking.Tracked]) -> Moved | None:
        return None


def shrinkable(storage: torch.UntypedStorage) -> bool:
    """Whether the portable backend may give a storage's memory back. Not one torch does
    not own (``from_blob``, numpy, some loaders): it cannot be resized. Not one in shared
    memory (``share_memory_()`` before handing a model to worker processes, a DataLoader
    worker's batch): other processes map it, and torch cannot grow such a storage back
    (a segfault). Either stays resident and intact, so its bytes need no copy either.
    (A CUDA storage counts as shared always; that says nothing about other processes.)"""
    return storage.resizable() and not (storage.device.type == "cpu" and storage.is_shared())


class PortableOffloader(Offloader):
    """Copies live storages out, then frees them by resizing them to zero bytes."""

    backend = "portable"

    def __init__(
        self,
        *,
        target: str,
        device: torch.device | str = "cpu",
        offload_dir: str | None = None,
        chunk_bytes: int = 256 << 20,
        scope: str = "all",
        skip_clean: bool | None = None,
        compression=None,
    ) -> None:
        super().__init__(target=target, device=device, scope=scope)
        if target == "disk":
            assert offload_dir is not None, "the disk target needs the rank's offload dir"
            self._mover = DiskMover(offload_dir, chunk_bytes, skip_clean=skip_clean, compression=compression)
        else:
            self._mover = HostMover()
        self._exclude = discovery.WeakStorages()  # the rollout's storages
        self._warned = False

    def _units(self) -> list[tracking.Tracked]:
        units = self.tracked()
        if self.scope == "all":
            seen = {u.key for u in units}
            units += [u for u in discovery.python_storages(self.device, exclude=self._exclude) if u.key not in seen]
        kept = [shrinkable(u.storage) for u in units]
        self._left_resident = sum(u.nbytes for u, shrinks in zip(units, kept) if not shrinks)
        units = [u for u, shrinks in zip(units, kept) if shrinks]
        for u in units:
            u.dead = self.liveness.dead(u.storage)
        drop_zeros(units)
        return units

    def _prepare(self, units: list[tracking.Tracked]) -> int:
        return self._mover.prepare(units)

    def _sleep(self, units: list[tracking.Tracked]) -> Moved:
        moved = self._mover.save(units)
        for u in units:
            u.storage.resize_(0)
        if self.device.type == "cuda":
            # Freed blocks stay in torch's cache until emptied; the rollout engine in
            # another process needs them back at the driver.
            torch.cuda.empty_cache()
        if not self._warned:
            self._warned = True
            self._warn_uncovered()
        return moved

    def _warn_uncovered(self) -> None:
        if self.device.type == "cuda":
            left = torch.cuda.memory_allocated(self.device) - self._exclude.nbytes_on(self.device)
            if left <= 0:
                return
            what = f"{left} bytes of torch's device memory stay allocated while the actor sleeps"
        else:
            what = "memory only C++ holds stays where it is while the actor sleeps"
        log.warning(
            f"actor offload (portable backend): {what} (tensors autograd saved for a pending "
            "backward, library workspaces, storages torch does not own or that are in shared "
            "memory, the rollout's): "
            "it is not moved and stays intact; the tms backend moves it"
        )

    def _wake(self, units: list[tracking.Tracked]) -> Moved:
        for u in units:
            if u.storage.nbytes() != u.nbytes:
                u.storage.resize_(u.nbytes)
        try:
            return self._mover.restore(units)
        except BaseException:
            # Still asleep: give the memory back again, so no tensor holds bytes that were
            # not (all) read back; the copies are intact and wake() can be tried again.
            for u in units:
                u.storage.resize_(0)
            raise

    @contextlib.contextmanager
    def rollout_region(self):
        """What the block allocates (and still holds at its end) is the rollout's, and
        never moves."""
        if self.scope != "all":
            yield
            return
        # By identity, not address: a storage the block allocates where one it freed was
        # is new all the same.
        before = discovery.WeakStorages(
            s for t in discovery.live_tensors() if (s := tracking.storage_of(t)) is not None
        )
        try:
            yield
        finally:
            for t in discovery.live_tensors():
                storage = tracking.storage_of(t)
                if storage is not None and storage not in before:
                    self._exclude.add(storage)

    @property
    def host_bytes(self) -> int:
        return self._mover.host_bytes

    def disk_bytes(self, way: str) -> int:
        return self._mover.disk_bytes(way)

    def record(self, timeline) -> bool:
        return self._mover.record(timeline)

    def close(self) -> None:
        try:
            super().close()
        finally:
            try:
                self._mover.close()
            finally:
                self._release_dir()
