"""Moving the bytes of the actor's units (storages or allocator runs) out and back: to
host memory or to a file.

A mover only copies; what happens to the device memory in between (freed by resizing
the storage, or unmapped by torch_memory_saver) is the backend's business. Both movers
restore exactly the bytes they took, so a wake is bit-identical by construction. Dead
units (``Tracked.dead``) are not copied and come back zero-filled.

Both keep their copies keyed by the unit's identity from one sleep to the next (host
copies are pinned, which is slow; file slots are preallocated), and a failed restore
keeps everything, so the wake can be tried again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from greenroom.actor.fingerprint import fingerprint
from greenroom.actor.tracking import Tracked
from greenroom.io import frames
from greenroom.io.engine import StateFile, TransferEngine, align_up
from greenroom.io.timeline import DISK, Timeline, span

STATE_FILE = "actor.state"


@dataclass(slots=True)
class Moved:
    """What one save or restore did, in bytes."""

    copied: int = 0
    """Bytes written out (save) or read back (restore)."""

    clean: int = 0
    """Bytes not written because the target already held them (unchanged since the last sleep)."""

    dead: int = 0
    """Bytes dropped (save) or zero-filled (restore)."""


def _zero_dead(units: list[Tracked]) -> int:
    dead = [u for u in units if u.dead]
    for u in dead:
        u.bytes_view().zero_()
    return sum(u.nbytes for u in dead)


class HostMover:
    """Copies to host memory: pinned (kept from one sleep to the next per unit, since
    pinning is slow) when the units live on a GPU, plain and released at wake otherwise."""

    def __init__(self) -> None:
        self._copies: dict[tuple, torch.Tensor] = {}

    def save(self, units: list[Tracked]) -> Moved:
        live = [u for u in units if not u.dead]
        pin = any(u.device.type == "cuda" for u in live)
        old, self._copies = self._copies, {}
        for u in live:
            host = old.get(u.key)
            if host is None or host.numel() != u.nbytes or not pin:
                host = torch.empty(u.nbytes, dtype=torch.uint8, pin_memory=pin)
            host.copy_(u.bytes_view(), non_blocking=pin)
            self._copies[u.key] = host
        if pin:
            torch.cuda.synchronize()
        return Moved(copied=sum(u.nbytes for u in live), dead=sum(u.nbytes for u in units if u.dead))

    def restore(self, units: list[Tracked]) -> Moved:
        pin = False
        copied = 0
        for u in units:
            if u.dead:
                continue
            host = self._copies[u.key]
            pin = pin or host.is_pinned()
            u.bytes_view().copy_(host, non_blocking=host.is_pinned())
            copied += u.nbytes
        dead = _zero_dead(units)
        if pin:
            torch.cuda.synchronize()
        else:
            self._copies = {}
        return Moved(copied=copied, dead=dead)

    def prepare(self, units: list[Tracked]) -> int:
        """Nothing to ready ahead of a sleep (``DiskMover.prepare``): 0 bytes written."""
        return 0

    def owned(self) -> list[torch.Tensor]:
        """The host copies: not the actor's memory, though on the CPU they share a device
        (the portable backend's scan skips every host mover's copies)."""
        return list(self._copies.values())

    @property
    def host_bytes(self) -> int:
        return sum(c.numel() for c in self._copies.values())

    def disk_bytes(self, way: str) -> int:
        return 0

    def record(self, timeline: Timeline | None) -> bool:
        """Host copies are not recorded (``greenroom.io.timeline``): False."""
        return False

    def close(self) -> None:
        self._copies = {}


# A unit is raw memory (a storage, a run of allocator blocks) whose dtype the mover does not
# know; a compressing codec splits it into 2-byte planes (Note [byte planes] of
# greenroom.io.compression), right for the bf16/fp16 weights and grads that make up most of an
# actor, and still a gain on fp32.
UNIT_ELEMENT_SIZES = ((0, 2),)


@dataclass(slots=True)
class _Slot:
    offset: int
    nbytes: int
    fingerprint: tuple[int, int] | None = None
    """Of the bytes the file holds at this slot, when known."""


class DiskMover:
    """Streams to one preallocated file in the rank's ``offload/`` dir through the shared
    I/O layer: host memory stays within the staging chunk whatever the actor's size.

    Each unit has a slot in the file, kept across sleeps while the unit keeps its key
    and size; a new unit takes the first gap that fits or the end (the file grows in
    place). With ``skip_clean`` a unit whose fingerprint equals that of the bytes its
    slot already holds is not written again (a frozen reference policy, a second sleep
    with no step between).
    """

    def __init__(self, directory: str, chunk_bytes: int, *, skip_clean: bool | None = None, compression=None) -> None:
        self.path = os.path.join(directory, STATE_FILE)
        self.compression = compression
        # A sleep only writes and a wake only reads: the wake's reads have the disk alone.
        # The engine's default 4 staging buffers, not the stream's 8 (``staging.stream_depth``):
        # with 8 of 32 MiB a compressed sleep kept more writes in flight but left the disk
        # idler and ran slower (docs/benchmarks.md, 'Design measurements').
        self._engine = TransferEngine(chunk_bytes, device_reads=frames.READS_ALONE)
        self._file: StateFile | None = None
        self._slots: dict[tuple, _Slot] = {}
        self.skip_clean = skip_clean

    def _place(self, units: list[Tracked]) -> StateFile:
        kept = {u.key: s for u in units if (s := self._slots.get(u.key)) is not None and s.nbytes == u.nbytes}
        taken = sorted((s.offset, s.offset + align_up(s.nbytes)) for s in kept.values())
        end = taken[-1][1] if taken else 0
        gaps, cursor = [], 0
        for start, stop in taken:
            if start > cursor:
                gaps.append([cursor, start])
            cursor = max(cursor, stop)
        slots = {}
        for u in units:
            if u.key in slots:
                continue
            slot = kept.get(u.key)
            if slot is None:
                need = align_up(u.nbytes)
                gap = next((g for g in gaps if g[1] - g[0] >= need), None)
                if gap is not None:
                    slot = _Slot(offset=gap[0], nbytes=u.nbytes)
                    gap[0] += need
                else:
                    slot = _Slot(offset=end, nbytes=u.nbytes)
                    end += need
            slots[u.key] = slot
        self._slots = slots
        size = max(end, 1)
        if self._file is None:
            self._file = StateFile(self.path, size, label="the actor's offload file", compression=self.compression)
        else:
            # In place: kept slots keep their bytes and their recorded checksums.
            self._file.grow(size)
        return self._file

    def prepare(self, units: list[Tracked]) -> int:
        """Place ``units`` as the next sleep will and write zeros once over the part of
        the file this adds (Note [backed blocks] of ``greenroom.io.statefile``), so that
        sleep only overwrites blocks the disk already backs, and fault the staging buffers
        in (``StagingBuffers.touch``); returns the bytes written.
        Only the file's new tail is written: every slot an earlier sleep wrote lies before
        it, so no byte a clean slot holds is touched. Running out of space is refused here,
        before anything is written; a file this call made is removed when it fails."""
        live = [u for u in units if not u.dead]
        self._engine.staging.touch()
        fresh = self._file is None
        before = 0 if fresh else self._file.allocated
        f = self._place(live)
        try:
            return f.write_zeros(before, f.allocated, buffer_bytes=self._engine.staging.buffer_bytes)
        except BaseException:
            if fresh:
                self._drop_file()
            raise

    def save(self, units: list[Tracked]) -> Moved:
        live = [u for u in units if not u.dead]
        f = self._place(live)
        moved = Moved(dead=sum(u.nbytes for u in units if u.dead))
        writes = []
        try:
            for u in live:
                slot = self._slots[u.key]
                view = u.bytes_view()
                skip = self.skip_clean if self.skip_clean is not None else view.is_cuda
                mark = fingerprint(view) if skip else None
                if mark is not None and mark == slot.fingerprint:
                    moved.clean += u.nbytes
                    continue
                slot.fingerprint = None  # unknown until the write is durable
                # Views must outlive their transfers: keep them until drain() returns.
                writes.append((slot, mark, view))
                self._engine.write(view, f, slot.offset, element_sizes=UNIT_ELEMENT_SIZES)
                moved.copied += u.nbytes
        except BaseException:
            self._engine.settle()  # before the caller's cleanup (Note [interrupted waits] of greenroom.io.engine)
            raise
        self._engine.drain()
        # Flush even with O_DIRECT: an O_DIRECT write can still sit in the drive's (or a
        # virtual disk host's) write cache, and flushing it then would land on the wake's
        # reads. The raw disk bound fdatasyncs too, so sleep is measured like for like.
        with span(self._engine.timeline, DISK):
            f.sync()
        for slot, mark, _ in writes:
            slot.fingerprint = mark
        return moved

    def restore(self, units: list[Tracked]) -> Moved:
        assert self._file is not None
        views = []
        copied = 0
        try:
            for u in units:
                if u.dead:
                    continue
                slot = self._slots[u.key]
                assert slot.nbytes == u.nbytes
                views.append(u.bytes_view())
                self._engine.read(views[-1], self._file, slot.offset)
                copied += u.nbytes
        except BaseException:
            # The failed wake frees the storages these reads fill: wait them out first
            # (Note [interrupted waits] of greenroom.io.engine).
            self._engine.settle()
            raise
        self._engine.drain()
        return Moved(copied=copied, dead=_zero_dead(units))

    @property
    def host_bytes(self) -> int:
        return self._engine.staging.total_bytes

    def disk_bytes(self, way: str) -> int:
        """Bytes ``written`` to or ``read`` from the offload file since it was opened."""
        return getattr(self._file, f"disk_bytes_{way}", 0)

    def record(self, timeline: Timeline | None) -> bool:
        """Record where the engine's time goes into ``timeline`` (``greenroom.io.timeline``): True."""
        self._engine.record(timeline)
        return True

    def _drop_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            self._slots = {}
            if os.path.exists(self.path):
                os.unlink(self.path)

    def close(self) -> None:
        try:
            self._engine.close()
        finally:
            self._drop_file()
