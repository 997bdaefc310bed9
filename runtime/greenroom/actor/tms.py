"""The CUDA backend on torch_memory_saver 0.0.10 (preload mode).

The process starts with ``launch_env``'s environment, so every ``cudaMalloc`` of the
process lives in torch_memory_saver's pausable region under its default tag. Sleep
pauses that tag: the physical memory goes back to the driver while the virtual
addresses stay reserved, and wake maps fresh memory at the same addresses, so every
pointer the trainer, NCCL or a CUDA graph holds stays valid.

Who moves the bytes is the ``mover``:

``greenroom`` (default)
    Sleep reads torch's caching allocator (its memory snapshot) and moves every live
    block of the actor's pools, tracked or not, through greenroom's own movers (pinned
    host copies, or the overlapped ``TransferEngine`` for disk), then pauses; the
    allocator's free cache is not moved (it comes back as fresh memory, which is all
    free memory promises). Memory in the region that torch did not allocate (a library
    calling ``cudaMalloc`` itself: NCCL with ``NCCL_CUMEM_ENABLE=0``, CuPy) cannot be
    enumerated: the pause shows it (the driver gets back more than torch's segments
    hold), and the sleep refuses in one line after putting the actor back as it was.
    The driver's free memory is the whole device's, so memory freed elsewhere during
    the pause (another process on the GPU, a library's thread) reads the same way; a
    foreign allocation shows at every pause and a coincidence does not, so the pause is
    measured again before a refusal (``released_by_pause``). greenroom processes of one
    user that share a GPU (``bench node``'s ranks, several actors on one device) take
    their pause measurements one at a time, under a lock file per device
    (``pause_lock``): ranks sleeping at once would otherwise read each other's pauses
    as foreign memory in every sample.
``tms``
    torch_memory_saver's own backup (pinned host, or files in the rank's ``offload/``
    dir): everything in the region comes back, at its speed.

The rollout allocates under a separate tag (``rollout_region``), which is never paused.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time

import torch

from greenroom.actor import discovery, launch
from greenroom.actor.movers import DiskMover, HostMover, Moved
from greenroom.actor.offloader import LeftAsleep, Offloader, drop_zeros
from greenroom.actor.tracking import Tracked
from greenroom.errors import GreenroomError, one_line

ACTOR_TAG = "default"  # the tag TMS_INIT_ENABLE gives every allocation
ROLLOUT_TAG = "rollout"
# torch_memory_saver maps every allocation in whole 2 MiB granules, and a pause releases
# exactly the bytes of torch's segments (docs/benchmarks.md, 'Design measurements'): any
# foreign allocation shows as at least one granule beyond them.
FOREIGN_SLACK = 1 << 20
# Pauses measured before a sleep is refused: memory freed elsewhere on the device during
# a pause reads as foreign in that pause only, an allocation in the region in every one
# (docs/benchmarks.md, 'Design measurements').
RELEASE_SAMPLES = 3


def released_by_pause(pause, resume, free_bytes, expected: int, samples: int = RELEASE_SAMPLES) -> int:
    """Pause (leaving the region paused) and return the device bytes the pause gave back.
    ``free_bytes`` is the driver's free memory, which the whole device moves: a sample
    above ``expected`` + ``FOREIGN_SLACK`` is taken again (resume, pause) up to
    ``samples`` times, and the last one is returned."""
    for sample in range(samples):
        if sample:
            resume()
        before = free_bytes()
        pause()
        released = free_bytes() - before
        if released - expected <= FOREIGN_SLACK:
            break
    return released


@contextlib.contextmanager
def pause_lock(device):
    """Hold this user's lock for ``device`` (a file per device UUID, in a 0700 dir of
    the user's under the temp dir) while the block runs; where the dir is not this
    user's or cannot be made, or the device has no properties to name it by, run unlocked
    (the lock only spares a false refusal)."""
    directory = os.path.join(tempfile.gettempdir(), f"greenroom-{os.getuid()}")
    fd = -1
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if os.lstat(directory).st_uid == os.getuid():
            fd = os.open(os.path.join(directory, f"pause-{uuid}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except (OSError, RuntimeError, AssertionError):  # no such dir of ours, or no CUDA device
        fd = -1
    try:
        if fd >= 0:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd >= 0:
            os.close(fd)  # releases the lock


def check_release(released: int, expected: int) -> None:
    """Refuse a pause that released more than torch's segments of the actor hold: the
    rest was device memory torch did not allocate, and its bytes are gone."""
    foreign = released - expected
    if foreign > FOREIGN_SLACK:
        raise GreenroomError(
            f"actor offload: the paused region held {foreign / (1 << 20):.0f} MiB that torch did not allocate "
            "(a library's own cudaMalloc, e.g. NCCL with NCCL_CUMEM_ENABLE=0 or CuPy) and the greenroom mover "
            "cannot move it: allocate it inside offloader.outside_region(), or use --offload-mover tms"
        )


class TmsOffloader(Offloader):
    backend = "tms"

    def __init__(
        self,
        *,
        target: str,
        device: torch.device | str = "cuda",
        offload_dir: str | None = None,
        chunk_bytes: int = 256 << 20,
        mover: str | None = None,
        scope: str = "all",
        skip_clean: bool | None = None,
        compression=None,
    ) -> None:
        super().__init__(target=target, device=device, scope=scope)
        if not launch.hooks_loaded():
            raise GreenroomError(
                "torch_memory_saver's hook is not preloaded: start the actor with "
                "greenroom.actor.launch_env(config, rank) (greenroom train does)"
            )
        self.mover = mover or os.environ.get(launch.MOVER_VAR, "greenroom")
        expected_disk = "1" if (self.mover == "tms" and target == "disk") else "0"
        if os.environ.get("TMS_INIT_ENABLE_DISK_BACKUP", "0") != expected_disk:
            raise GreenroomError(
                f"the actor was launched for another target or mover than {target}/{self.mover}: "
                "relaunch it with launch_env for these settings"
            )
        from torch_memory_saver import torch_memory_saver  # CUDA only: needs libcuda

        self._tms = torch_memory_saver
        # torch_memory_saver's own share of the last transition (all of it for mover tms).
        self.pause_seconds = self.resume_seconds = 0.0
        self._paused = False
        self._given_back = False  # a pause of this sleep gave the device bytes back
        self._tms_moved = 0  # bytes torch_memory_saver's own mover backed up at the last sleep
        if self.mover == "tms":
            self._mover = None
            if target == "disk":
                self._tms.set_disk_backup_dir(offload_dir)
        elif target == "disk":
            self._mover = DiskMover(offload_dir, chunk_bytes, skip_clean=skip_clean, compression=compression)
        else:
            self._mover = HostMover()

    def _units(self) -> list[Tracked]:
        if self._mover is None:
            return []  # torch_memory_saver's backup moves the whole region
        if self.scope == "tracked":
            units = self.tracked()
            for u in units:
                u.dead = self.liveness.dead(u.storage)
        else:
            dead = {s.data_ptr() for s in self.liveness.dead_storages() if s.device.type == "cuda"}
            units = discovery.allocator_runs(self.device, exclude_pools=self._excluded_pools(), dead_addresses=dead)
        drop_zeros(units)
        return units

    def _excluded_pools(self) -> set:
        return discovery.excluded_pools_of(self._tms, ACTOR_TAG)

    def _actor_segment_bytes(self) -> int:
        segments = discovery.allocator_segments(self.device, exclude_pools=self._excluded_pools())
        return sum(s["total_size"] for s in segments)

    def _pause(self) -> None:
        self._tms.pause(ACTOR_TAG)
        self._paused = self._given_back = True

    def _resume(self) -> None:
        self._tms.resume(ACTOR_TAG)
        self._paused = False

    def _prepare(self, units: list[Tracked]) -> int:
        # torch_memory_saver's own mover keeps its own files: greenroom has none to ready.
        return self._mover.prepare(units) if self._mover is not None else 0

    def _sleep(self, units: list[Tracked]) -> Moved | None:
        moved = self._mover.save(units) if self._mover is not None else None
        torch.cuda.synchronize(self.device)
        expected = self._actor_segment_bytes()
        start = time.perf_counter()
        if self._mover is None:
            self._pause()
            self.pause_seconds = time.perf_counter() - start
            # torch_memory_saver's own mover backs up every segment of the actor's pools:
            # that is what it copied (the bench's rates divide by it).
            self._tms_moved = expected
            return Moved(copied=expected)
        # The mover holds every byte already, so a pause taken again loses nothing more.
        self._given_back = False
        try:
            with pause_lock(self.device):
                released = released_by_pause(
                    self._pause, self._resume, lambda: torch.cuda.mem_get_info(self.device)[0], expected
                )
            self.pause_seconds = time.perf_counter() - start
            self.last_release = (released, expected)
            check_release(released, expected)
        except BaseException as failed:
            if not self._given_back:
                raise  # the first pause did not happen: the device holds every byte as it was
            # Refused, or stopped (an error, a signal) once a pause had given the bytes back:
            # only the mover holds them now.
            try:
                self._wake(units)  # put the actor back as it was (but for any foreign bytes)
            except BaseException as undo:
                refused = str(failed) if isinstance(failed, GreenroomError) else one_line(failed)
                raise LeftAsleep(
                    f"{refused}; putting the actor back then failed ({one_line(undo)}): it is asleep "
                    "with its copies whole: call wake() to retry"
                ) from undo
            raise
        return moved

    def _wake(self, units: list[Tracked]) -> Moved | None:
        if self._paused:  # a retried wake does not resume twice
            start = time.perf_counter()
            self._resume()
            self.resume_seconds = time.perf_counter() - start
        if self._mover is None:
            return Moved(copied=self._tms_moved)
        return self._mover.restore(units)

    def rollout_region(self):
        return self._tms.region(tag=ROLLOUT_TAG)

    def outside_region(self):
        """Allocations made here are not in the paused region at all (they stay put and
        keep their bytes): for memory torch does not allocate, e.g. an NCCL communicator
        created with NCCL_CUMEM_ENABLE=0."""
        return self._tms.disable()

    @property
    def host_bytes(self) -> int:
        return self._mover.host_bytes if self._mover is not None else 0

    def disk_bytes(self, way: str) -> int:
        return self._mover.disk_bytes(way) if self._mover is not None else 0

    def record(self, timeline) -> bool:
        return self._mover.record(timeline) if self._mover is not None else False

    def close(self) -> None:
        try:
            super().close()
        finally:
            try:
                if self._mover is not None:
                    self._mover.close()
            finally:
                self._release_dir()
