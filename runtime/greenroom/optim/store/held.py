"""The buckets whose newest bytes are held off their files between steps: the host
cache's, and the bucket the last step kept on the device.

``HeldBuckets`` is the part of ``BucketStore`` that keeps them (the store owns one, beside
the ``optim.store.hostcache.HostCache`` it hands it and the ``optim.store.files.BucketFiles``
of the files themselves): the kept bucket, the order a stream takes so that it starts on
it, and the write-backs that make the files whole again (``flush``) before anything
reads them around the stream.

Note [host cache]: whole buckets, as many as fit in ``host_cache_bytes``, live in host
memory (pinned when the store's device is CUDA) instead of going to the disk each step.
Which: the buckets in order, each taken while it still fits (a bucket too large for
what is left is skipped, a later smaller one may still be taken). Every cached byte
saves the same disk traffic, two bytes a step (read and written back), so no choice
saves more than filling the budget, and the order makes the choice plain from the
layout. ``stream()`` copies a cached bucket host -> device buffer and back on a copy
stream, overlapped as the disk path is, and never touches its file. The files of cached
buckets stay preallocated (running out of space is still a setup error) but go stale
while the run lives: ``initialize``/``overwrite`` fill the cache instead of the file,
and every step writes back to the cache. So whatever reads the files around the
stream (a checkpoint's copy, the memory-mapped state dict) calls ``flush()`` first,
which writes the stale ones out through the engine (checksummed, synced), and whatever
replaces the files around the engine (a checkpoint's load) calls
``refill_host_cache()``, which reads them back (verified). ``close()`` flushes, so the
files hold the state afterwards. With ``host_cache_bytes`` 0 nothing of this runs.

Note [the last bucket stays]: the last bucket a step updates is not written back when
the step ends. Its bytes stay in the device buffer they were updated in, and the next
stream takes that bucket first and starts on them without a read. Back-to-back steps
then move one bucket less each way, and they lose the two parts of the step that the
pipeline cannot overlap: the first read, before any update can start, and the last
write-back, after the last update. It costs no device memory, since the buffers live
between steps anyway. The bytes are the ones the file would have given back, so the
step is the same to the bit.
While a bucket is kept its file is stale, as a cached bucket's is (Note [host cache]).
So every path that reads the files, reuses the buffers or replaces the state writes it
back first: ``flush`` (and through it checkpoints, state dicts and ``close``),
``release_device_buffers`` (before the actor sleeps), ``initialize``, ``overwrite``, and
a stream that does not take it. A load that replaces the whole state drops it instead
(``discard_kept``). Where its file is shared (``optim.store.files`` Note [new
inodes]) the new file the step made for it is kept with it, so running out of space
still fails at the step, not at a later write-back. A step that writes an in-step
checkpoint writes back every bucket it streams, and a cached bucket is never kept (its
write-back is a host copy already). A stream that fails or is closed before the kept
bucket's write-back began leaves it kept.
A kill meanwhile loses nothing a run resumes from: the files live only as long as the
run (the rank dir removes them), and resumes come from checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from greenroom.io.engine import StateFile, TransferEngine
from greenroom.optim.store.buffers import DeviceBuffer
from greenroom.optim.store.files import BucketFiles, Replacement
from greenroom.optim.store.hostcache import HostCache
from greenroom.optim.store.layout import Bucket


@dataclass(eq=False, slots=True)
class Kept:
    """The bucket a step left in a device buffer (Note [the last bucket stays]), and the
    new file made for it where its live file is shared (``optim.store.files`` Note
    [new inodes])."""

    index: int
    buffer: DeviceBuffer
    new_file: StateFile | None


class WriteBucket(Protocol):
    """How the store writes a bucket's bytes through the engine (``BucketStore`` tells a
    codec each segment's element size): to ``file``, and the ``Transfer`` to wait on."""

    def __call__(self, raw: torch.Tensor, bucket: Bucket, *, file: StateFile): ...


class HeldBuckets:
    """The kept bucket of a ``BucketStore`` and the write-backs of what it and the host
    cache hold (Notes [host cache], [the last bucket stays]). The store owns one and
    hands it its own ``buckets`` list (the buckets it adds are this object's too), its
    files, engine and host cache, and ``write``, its way of writing a bucket.

    ``bytes_read``/``bytes_written``: the file bytes this object moved (the store adds
    them to its stream's)."""

    def __init__(
        self,
        buckets: list[Bucket],
        bucket_files: BucketFiles,
        engine: TransferEngine,
        cache: HostCache,
        write: WriteBucket,
    ) -> None:
        self.buckets = buckets
        self.bucket_files = bucket_files
        self.engine = engine
        self.cache = cache
        self.write = write
        self.kept: Kept | None = None  # Note [the last bucket stays]
        self.bytes_read = 0
        self.bytes_written = 0

    def write_cached(self, index: int, file: StateFile):
        """Write cached bucket ``index``'s host bytes to ``file`` (no read: the cache is the state)."""
        return self.write(self.cache.tensors[index], self.buckets[index], file=file)

    @property
    def disk_bytes_per_step(self) -> int:
        """Bytes of the files a step reads (and writes back) when no bucket is kept: the
        uncached buckets'."""
        return sum(b.file_bytes for b in self.buckets if b.index not in self.cache)

    @property
    def kept_bytes(self) -> int:
        """File bytes of the bucket kept on the device since the last step (Note [the last
        bucket stays]): what the next step neither reads nor, until it ends, writes."""
        return self.buckets[self.kept.index].file_bytes if self.kept is not None else 0

    def take_kept(self) -> Kept | None:
        """The kept bucket, which a stream takes over: none is kept after."""
        kept, self.kept = self.kept, None
        return kept

    def keep(self, kept: Kept | None) -> None:
        """Keep ``kept`` on the device until the next stream (None: keep none)."""
        self.kept = kept

    def store_bucket(self, index: int, raw: torch.Tensor) -> None:
        """Put a whole bucket's bytes where it lives: its cache (the file goes stale), or
        its file (written, synced, its pages dropped)."""
        if index in self.cache:
            self.cache.put(index, raw)
            return
        self.store_file(index, raw)

    def order(self, order: list[int], kept: int | None) -> list[int]:
        """A stream's order (Note [the last bucket stays]): the kept bucket first, read from
        no file, and last the largest bucket outside the host cache, which the stream keeps
        (the largest saves the most)."""
        rest = [i for i in order if i != kept]
        uncached = [i for i in rest if i not in self.cache]
        if uncached:
            last = max(reversed(uncached), key=lambda i: self.buckets[i].file_bytes)  # the latest of equals
            rest.remove(last)
            rest.append(last)
        return rest if kept is None else [kept, *rest]

    def flush(self) -> None:
        """Make every bucket file hold the live state: drain I/O, then write the cached
        buckets whose files are stale out through the engine (checksummed) and sync
        them. Call it before reading the files around the stream."""
        self.engine.drain()
        self.cache.sync()
        self.write_back_kept()
        stale = sorted(self.cache.stale)
        for index in stale:
            self.store_file(index, self.cache.tensors[index])
            self.cache.stale.discard(index)

    def store_file(self, index: int, raw: torch.Tensor) -> None:
        """Write a whole bucket's bytes to its file, synced, its pages dropped; to a new
        inode when the file is shared (``optim.store.files`` Note [new inodes])."""
        fresh = self.bucket_files.new_files([index])
        replacing = Replacement(index, fresh[index], False) if fresh else None
        file = replacing.file if replacing is not None else self.bucket_files.files[index]
        try:
            self.write(raw, self.buckets[index], file=file).wait()
            file.sync()
        except BaseException:
            if replacing is not None:
                self.bucket_files.drop(replacing)
            raise
        if replacing is not None:
            self.bucket_files.install(replacing)
        self.bytes_written += self.buckets[index].file_bytes

    def write_back_kept(self) -> None:
        """Write the kept bucket to its file (Note [the last bucket stays]). If that fails
        it stays kept: its buffer holds the only copy of its state."""
        kept = self.kept
        if kept is None:
            return
        raw = kept.buffer.raw[: self.buckets[kept.index].data_bytes]
        if kept.new_file is None:
            self.store_file(kept.index, raw)
        else:
            self.write(raw, self.buckets[kept.index], file=kept.new_file).wait()
            kept.new_file.sync()
            self.bucket_files.install(Replacement(kept.index, kept.new_file, False))
            self.bytes_written += self.buckets[kept.index].file_bytes
        self.kept = None

    def discard_kept(self) -> None:
        """Drop the kept bucket's bytes unwritten (and the new file made for it): the whole
        state is about to be replaced around the engine (a checkpoint's load), and they
        would overwrite its bucket."""
        kept, self.kept = self.kept, None
        if kept is not None and kept.new_file is not None:
            self.bucket_files.drop(Replacement(kept.index, kept.new_file, False))

    def discard(self) -> None:
        """Forget what the files lack, unwritten: the stale cached buckets and the kept
        bucket (a store dropped unclosed, whose files no one reads again)."""
        self.cache.stale.clear()
        self.discard_kept()

    def refill(self) -> None:
        """Read the cached buckets back from their files (verified against the files'
        checksums): after the files were replaced around the engine (a checkpoint's load)."""
        self.engine.drain()
        self.cache.sync()
        for index, host in self.cache.tensors.items():
            self.engine.read(host, self.bucket_files.files[index], 0)
            self.bytes_read += self.buckets[index].file_bytes
        self.engine.drain()
        self.cache.stale.clear()
