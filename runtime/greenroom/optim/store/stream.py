"""A step's pass over a ``BucketStore``'s buckets: each bucket read ahead into a device
buffer, yielded to the caller as fp32 state, and written back behind.

``BucketStream`` is the part of ``BucketStore`` that runs ``stream()`` (the store owns
one, and hands it its own ``buckets`` list and the parts the pass goes through: the
``optim.store.files.BucketFiles``, the ``optim.store.buffers.DeviceBuffers`` it rotates,
the ``optim.store.hostcache.HostCache``, the ``optim.store.held.HeldBuckets`` of the kept
bucket, the ``optim.store.views.StateViews`` and the engine). ``StepCheckpoint`` is what
it asks of an in-step checkpoint (``optim.checkpoint.instep``).
"""

from __future__ import annotations

from typing import Iterator, Protocol, Sequence

import torch

from greenroom.io.engine import StateFile, TransferEngine
from greenroom.optim.store.buffers import DeviceBuffer, DeviceBuffers
from greenroom.optim.store.files import BucketFiles, Replacement
from greenroom.optim.store.held import HeldBuckets, Kept
from greenroom.optim.store.hostcache import HostCache, HostCopy
from greenroom.optim.store.layout import DEVICE_BUFFERS, Bucket, BucketState
from greenroom.optim.store.views import StateViews


class StepCheckpoint(Protocol):
    """What ``BucketStore.stream`` asks of the checkpoint a step writes (``optim.checkpoint.instep``)."""

    links: bool
    """True: the checkpoint takes each bucket's file by a link (the live file once written
    in place, or, where the live inode is shared, the checkpoint's own new file, which
    the live name then links); False: each bucket is written to the checkpoint's file
    too, a second write from the same staging."""

    def bucket_file(self, index: int) -> StateFile | None:
        """The checkpoint's file of bucket ``index`` (None: not through the stream)."""

    def link_live(self, index: int) -> None:
        """Bucket ``index``'s live file now holds the step's result: link it in."""


class WriteMirrored(Protocol):
    """How the store writes a bucket's bytes through the engine: to its live file (or
    ``file``), and to ``mirror`` too; the ``Transfer`` to wait on."""

    def __call__(
        self, raw: torch.Tensor, bucket: Bucket, *, file: StateFile | None = None, mirror: StateFile | None = None
    ): ...


class BucketStream:
    """The stream of a ``BucketStore``: ``run`` is its ``stream()``.

    ``bytes_read``/``bytes_written``: the file bytes the stream moved (the store adds the
    held buckets' write-backs to them)."""

    def __init__(
        self,
        buckets: list[Bucket],
        bucket_files: BucketFiles,
        buffers: DeviceBuffers,
        cache: HostCache,
        held: HeldBuckets,
        views: StateViews,
        engine: TransferEngine,
        write: WriteMirrored,
    ) -> None:
        self.buckets = buckets
        self.bucket_files = bucket_files
        self.buffers = buffers
        self.cache = cache
        self.held = held
        self.views = views
        self.engine = engine
        self._write = write
        self.bytes_read = 0
        self.bytes_written = 0

    def run(
        self, indices: Sequence[int] | None = None, *, checkpoint: StepCheckpoint | None = None
    ) -> Iterator[BucketState]:
        """``BucketStore.stream``: the buckets ``indices`` (default all) yielded on the
        device, read ahead and written back behind (see there)."""
        order = list(range(len(self.buckets))) if indices is None else list(indices)
        if not order:
            return
        linked = checkpoint is not None and checkpoint.links
        if self.held.kept is not None and self.held.kept.index not in order:
            self.held.write_back_kept()
        kept = self.held.take_kept()
        if kept is not None and linked and kept.new_file is not None:  # the checkpoint brings a new file
            self.bucket_files.drop(Replacement(kept.index, kept.new_file, False))
            kept.new_file = None
        order = self.held.order(order, kept.index if kept is not None else None)
        try:
            unkept = [i for i in order if i not in self.cache and (kept is None or i != kept.index)]
            fresh = {} if linked else self.bucket_files.new_files(unkept)
        except BaseException:
            self.held.keep(kept)
            raise
        if kept is not None and kept.new_file is not None:
            fresh[kept.index] = kept.new_file
        buffers = self.buffers.ring(min(DEVICE_BUFFERS, len(order)), kept.buffer if kept is not None else None)
        pending = HostCopy() if kept is not None else self._submit_read(order[0], buffers[0])
        last = None  # the bucket to keep on the device when the stream ends
        failed = True
        try:
            for k, index in enumerate(order):
                buffer = buffers[k % len(buffers)]
                pending.wait()
                if k + 1 < len(order):
                    ahead = buffers[(k + 1) % len(buffers)]
                    self._finish_write(ahead, checkpoint)  # its last bucket leaves that buffer before k+1 comes in
                    pending = self._submit_read(order[k + 1], ahead)
                state = self.views.decode(index, buffer.raw)
                yield state
                self.views.encode(state, buffer.raw)
                if k + 1 == len(order) and checkpoint is None and index not in self.cache:
                    last = Kept(index, buffer, fresh.pop(index, None))
                else:
                    self._submit_write(index, buffer, checkpoint, fresh)
                kept = None  # its bytes are this stream's now: written back, or kept again as ``last``
            failed = False
        finally:
            if kept is not None:  # failed or closed before its write-back began: its file never had them
                self.held.keep(kept)
                fresh.pop(kept.index, None)
            try:
                self.engine.drain()
            except BaseException:
                failed = True
                raise
            finally:
                self.cache.sync()
                for buffer in buffers:
                    buffer.write = None
                    if failed:
                        replacing, buffer.replacing, buffer.link_out = buffer.replacing, None, None
                        if replacing is not None:
                            self.bucket_files.drop(replacing)
                    else:
                        self._finish_write(buffer, checkpoint)
                for index, f in fresh.items():  # made for a bucket the stream never wrote
                    self.bucket_files.drop(Replacement(index, f, False))
                if last is not None:  # updated, even where another bucket's write-back failed
                    self.held.keep(last)

    def _finish_write(self, buffer: DeviceBuffer, checkpoint: StepCheckpoint | None) -> None:
        """Wait for the write still reading ``buffer``; give its new file the live name, or
        have the checkpoint link the live file it wrote in place."""
        if buffer.write is not None:
            write, buffer.write = buffer.write, None
            write.wait()
        replacing, buffer.replacing = buffer.replacing, None
        if replacing is not None:
            self.bucket_files.install(replacing)
        link_out, buffer.link_out = buffer.link_out, None
        if link_out is not None:
            checkpoint.link_live(link_out)

    def _submit_read(self, index: int, buffer: DeviceBuffer):
        bucket = self.buckets[index]
        raw = buffer.raw[: bucket.data_bytes]
        if index in self.cache:
            return self.cache.read(index, raw)
        self.bytes_read += bucket.file_bytes
        return self.engine.read(raw, self.bucket_files.files[index], 0)

    def _submit_write(
        self, index: int, buffer: DeviceBuffer, checkpoint: StepCheckpoint | None, fresh: dict[int, StateFile]
    ) -> None:
        """Start the write-back of bucket ``index`` from ``buffer``: to its cache, to a new
        file (the checkpoint's, or ``fresh``'s for a shared file), or in place; with a
        mirror file of the checkpoint's too where it writes twice."""
        bucket = self.buckets[index]
        raw = buffer.raw[: bucket.data_bytes]
        target = checkpoint.bucket_file(index) if checkpoint is not None else None
        if index in self.cache:
            buffer.write = self.cache.write(index, raw)
            return
        self.bytes_written += bucket.file_bytes
        mirror = None
        if target is not None and checkpoint.links and self.bucket_files.shared(index):
            buffer.replacing = Replacement(index, target, True)
        elif target is not None and checkpoint.links:
            buffer.link_out = index  # in place (no other name shares it), then linked into the checkpoint
        elif index in fresh:
            buffer.replacing = Replacement(index, fresh.pop(index), False)
            mirror = target
        else:
            mirror = target
        file = buffer.replacing.file if buffer.replacing is not None else None
        buffer.write = self._write(raw, bucket, file=file, mirror=mirror)
