"""The CUDA backend on torch_memory_saver 0.0.10 (preload mode).

The process starts with ``launch_env``'s environment, so every device allocation lives
in torch_memory_saver's pausable region under its default tag. Sleep pauses that tag:
the physical memory goes back to the driver while the virtual addresses stay reserved,
and wake maps fresh memory at the same addresses, so every pointer the trainer, NCCL or
a CUDA graph holds stays valid.

Who moves the bytes is the ``mover``:

``greenroom`` (default)
    torch_memory_saver only releases and re-maps; greenroom's own movers copy the
    tracked state first (pinned host copies, or the overlapped ``TransferEngine`` for
    disk). This is what reaches the disk's and the PCIe link's bandwidth: its own disk
    path is one synchronous staging buffer. Memory of the region that is not tracked
    (free allocator cache, activations, workspaces) is scratch and comes back with
    undefined contents.
``tms``
    torch_memory_saver's own backup (pinned host, or files in the rank's ``offload/``
    dir): everything in the region comes back, tracked or not, at its speed.

The rollout allocates under a separate tag (``rollout_region``), which is never paused.
"""

from __future__ import annotations

import os
import time

import torch

from greenroom.actor import launch
from greenroom.actor.movers import DiskMover, HostMover
from greenroom.actor.offloader import Offloader
from greenroom.actor.tracking import Tracked
from greenroom.errors import GreenroomError

ACTOR_TAG = "default"  # the tag TMS_INIT_ENABLE gives every allocation
ROLLOUT_TAG = "rollout"


class TmsOffloader(Offloader):
    backend = "tms"

    def __init__(self, *, target: str, device: torch.device | str = "cuda", offload_dir: str | None = None,
                 chunk_bytes: int = 256 << 20, mover: str | None = None) -> None:
        super().__init__(target=target, device=device)
        if not launch.hooks_loaded():
            raise GreenroomError("torch_memory_saver's hook is not preloaded: start the actor with "
                                 "greenroom.actor.launch_env(config, rank) (greenroom train does)")
        self.mover = mover or os.environ.get(launch.MOVER_VAR, "greenroom")
        expected_disk = "1" if (self.mover == "tms" and target == "disk") else "0"
        if os.environ.get("TMS_INIT_ENABLE_DISK_BACKUP", "0") != expected_disk:
            raise GreenroomError(f"the actor was launched for another target or mover than {target}/{self.mover}: "
                                 "relaunch it with launch_env for these settings")
        from torch_memory_saver import torch_memory_saver  # CUDA only: needs libcuda

        self._tms = torch_memory_saver
        # torch_memory_saver's own share of the last transition (all of it for mover tms).
        self.pause_seconds = self.resume_seconds = 0.0
        if self.mover == "tms":
            self._mover = None
            if target == "disk":
                self._tms.set_disk_backup_dir(offload_dir)
        elif target == "disk":
            self._mover = DiskMover(offload_dir, chunk_bytes)
        else:
            self._mover = HostMover()

    def _sleep(self, tracked: list[Tracked]) -> None:
        if self._mover is not None:
            self._mover.save(tracked)
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        self._tms.pause(ACTOR_TAG)
        self.pause_seconds = time.perf_counter() - start

    def _wake(self, tracked: list[Tracked]) -> None:
        start = time.perf_counter()
        self._tms.resume(ACTOR_TAG)
        self.resume_seconds = time.perf_counter() - start
        if self._mover is not None:
            self._mover.restore(tracked)

    def rollout_region(self):
        return self._tms.region(tag=ROLLOUT_TAG)

    @property
    def host_bytes(self) -> int:
        return self._mover.host_bytes if self._mover is not None else 0

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self._mover is not None:
                self._mover.close()
