"""Moving the bytes of tracked storages out and back: to host memory or to a file.

A mover only copies; what happens to the device memory in between (freed by resizing
the storage, or unmapped by torch_memory_saver) is the backend's business. Both movers
restore exactly the bytes they took, so a wake is bit-identical by construction.
"""

from __future__ import annotations

import os

import torch

from greenroom.actor.tracking import Tracked
from greenroom.diskio import StateFile, TransferEngine, align_up

STATE_FILE = "actor.state"


class HostMover:
    """Copies to host memory: pinned (reused from one sleep to the next, since pinning is
    slow) when the storages live on a GPU, plain and released at wake otherwise."""

    def __init__(self) -> None:
        self._copies: list[torch.Tensor] = []
        self._layout: tuple[int, ...] = ()

    def save(self, tracked: list[Tracked]) -> None:
        layout = tuple(t.nbytes for t in tracked)
        pin = any(t.device.type == "cuda" for t in tracked)
        if layout != self._layout or not pin:
            self._copies = [torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in layout]
            self._layout = layout
        for t, host in zip(tracked, self._copies):
            host.copy_(t.bytes_view(), non_blocking=pin)
        if pin:
            torch.cuda.synchronize()

    def restore(self, tracked: list[Tracked]) -> None:
        pin = False
        for t, host in zip(tracked, self._copies):
            pin = pin or host.is_pinned()
            t.bytes_view().copy_(host, non_blocking=host.is_pinned())
        if pin:
            torch.cuda.synchronize()
        else:
            self._copies, self._layout = [], ()

    @property
    def host_bytes(self) -> int:
        return sum(c.numel() for c in self._copies)

    def close(self) -> None:
        self._copies, self._layout = [], ()


class DiskMover:
    """Streams to one preallocated file in the rank's ``offload/`` dir through the shared
    I/O layer: host memory stays within the staging chunk whatever the actor's size.
    The file is overwritten in place every sleep and rebuilt only when the layout changes
    (the optimizer's state appears after the first step)."""

    def __init__(self, directory: str, chunk_bytes: int) -> None:
        self.path = os.path.join(directory, STATE_FILE)
        self._engine = TransferEngine(chunk_bytes)
        self._file: StateFile | None = None
        self._layout: tuple[int, ...] = ()
        self._offsets: list[int] = []

    def _file_for(self, layout: tuple[int, ...]) -> StateFile:
        if self._file is not None and layout == self._layout:
            return self._file
        self._drop_file()
        offsets, end = [], 0
        for n in layout:
            offsets.append(end)
            end += align_up(n)
        self._file = StateFile(self.path, max(end, 1), label="the actor's offload file")
        self._layout, self._offsets = layout, offsets
        return self._file

    def save(self, tracked: list[Tracked]) -> None:
        f = self._file_for(tuple(t.nbytes for t in tracked))
        # Views must outlive their transfers: keep them until drain() returns.
        views = [t.bytes_view() for t in tracked]
        for view, offset in zip(views, self._offsets):
            self._engine.write(view, f, offset)
        self._engine.drain()
        # Flush even with O_DIRECT: an O_DIRECT write can still sit in the drive's (or a
        # virtual disk host's) write cache, and flushing it then would land on the wake's
        # reads. The raw disk bound fdatasyncs too, so sleep is measured like for like.
        f.sync()

    def restore(self, tracked: list[Tracked]) -> None:
        assert self._file is not None and tuple(t.nbytes for t in tracked) == self._layout
        views = [t.bytes_view() for t in tracked]
        for view, offset in zip(views, self._offsets):
            self._engine.read(view, self._file, offset)
        self._engine.drain()

    @property
    def host_bytes(self) -> int:
        return self._engine.staging.total_bytes

    def _drop_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            if os.path.exists(self.path):
                os.unlink(self.path)

    def close(self) -> None:
        try:
            self._engine.close()
        finally:
            self._drop_file()
