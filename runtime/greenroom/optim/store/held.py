"""The buckets whose newest bytes are held off their files between steps: the host
cache's, and the bucket the last step kept on the device.

``HeldBuckets`` is the part of ``BucketStore`` that keeps them (a base class of the store;
the files themselves are the store's ``optim.store.files.BucketFiles``): which buckets the host cache holds, the order a
stream takes so that it starts on the kept bucket, and the write-backs that make the
files whole again (``flush``) before anything reads them around the stream.

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
from typing import Sequence

import torch

from greenroom.io.engine import StateFile, TransferEngine
from greenroom.optim.store.files import DeviceBuffer, Replacement
from greenroom.optim.store.hostcache import HostCopy, host_memory


@dataclass(eq=False, slots=True)
class Kept:
    """The bucket a step left in a device buffer (Note [the last bucket stays]), and the
    new file made for it where its live file is shared (``optim.store.files`` Note
    [new inodes])."""

    index: int
    buffer: DeviceBuffer
    new_file: StateFile | None


class HeldBuckets:
    """The host cache and the kept bucket of a ``BucketStore`` (a base class: it uses the
    store's ``engine``, ``device``, ``bytes_read``/``bytes_written`` and ``_write``)."""

    engine: TransferEngine
    device: torch.device
    host_cache_budget: int
    host_cache: dict[int, torch.Tensor]  # bucket index -> its bytes (Note [host cache])
    _stale: set[int]  # cached buckets whose file lags behind the cache
    _kept: Kept | None  # Note [the last bucket stays]
    _pinned: bool
    _copy_stream: torch.cuda.Stream | None
    bytes_read: int
    bytes_written: int

    def write_cached(self, index: int, file: StateFile):
        """Write cached bucket ``index``'s host bytes to ``file`` (no read: the cache is the state)."""
        return self._write(self.host_cache[index], self.buckets[index], file=file)

    @property
    def host_cache_bytes(self) -> int:
        """Host memory the cached buckets take (at most ``host_cache_budget``)."""
        return sum(t.numel() for t in self.host_cache.values())

    @property
    def disk_bytes_per_step(self) -> int:
        """Bytes of the files a step reads (and writes back) when no bucket is kept: the
        uncached buckets'."""
        return sum(b.file_bytes for b in self.buckets if b.index not in self.host_cache)

    @property
    def kept_bytes(self) -> int:
        """File bytes of the bucket kept on the device since the last step (Note [the last
        bucket stays]): what the next step neither reads nor, until it ends, writes."""
        return self.buckets[self._kept.index].file_bytes if self._kept is not None else 0

    def _store_bucket(self, index: int, raw: torch.Tensor) -> None:
        """Put a whole bucket's bytes where it lives: its cache (the file goes stale), or
        its file (written, synced, its pages dropped)."""
        host = self.host_cache.get(index)
        if host is not None:
            host.copy_(raw)
            self._stale.add(index)
            return
        self._store_file(index, raw)

    def _cache_buckets(self, indices: Sequence[int]) -> None:
        """Give the buckets ``indices`` host memory while the budget lasts (Note [host cache])."""
        left = self.host_cache_budget - self.host_cache_bytes
        for index in indices:
            nbytes = self.buckets[index].data_bytes
            if nbytes <= left:
                self.host_cache[index] = host_memory(nbytes, self._pinned)
                left -= nbytes

    def _order(self, order: list[int], kept: int | None) -> list[int]:
        """A stream's order (Note [the last bucket stays]): the kept bucket first, read from
        no file, and last the largest bucket outside the host cache, which the stream keeps
        (the largest saves the most)."""
        rest = [i for i in order if i != kept]
        uncached = [i for i in rest if i not in self.host_cache]
        if uncached:
            last = max(reversed(uncached), key=lambda i: self.buckets[i].file_bytes)  # the latest of equals
            rest.remove(last)
            rest.append(last)
        return rest if kept is None else [kept, *rest]

    def _host_copy(self, dst: torch.Tensor, src: torch.Tensor, *, to_device: bool) -> HostCopy:
        """Copy between a device buffer and the host cache: on the CPU at once; on CUDA on
        the store's copy stream, after what the caller's stream has queued, so it runs
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

    def _sync_host_copies(self) -> None:
        if self._copy_stream is not None:
            self._copy_stream.synchronize()

    def flush(self) -> None:
        """Make every bucket file hold the live state: drain I/O, then write the cached
        buckets whose files are stale out through the engine (checksummed) and sync
        them. Call it before reading the files around the stream."""
        self.engine.drain()
        self._sync_host_copies()
        self._write_back_kept()
        stale = sorted(self._stale)
        for index in stale:
            self._store_file(index, self.host_cache[index])
            self._stale.discard(index)

    def _store_file(self, index: int, raw: torch.Tensor) -> None:
        """Write a whole bucket's bytes to its file, synced, its pages dropped; to a new
        inode when the file is shared (``optim.store.files`` Note [new inodes])."""
        fresh = self.bucket_files.new_files([index])
        replacing = Replacement(index, fresh[index], False) if fresh else None
        file = replacing.file if replacing is not None else self.files[index]
        try:
            self._write(raw, self.buckets[index], file=file).wait()
            file.sync()
        except BaseException:
            if replacing is not None:
                self.bucket_files.drop(replacing)
            raise
        if replacing is not None:
            self.bucket_files.install(replacing)
        self.bytes_written += self.buckets[index].file_bytes

    def _write_back_kept(self) -> None:
        """Write the kept bucket to its file (Note [the last bucket stays]). If that fails
        it stays kept: its buffer holds the only copy of its state."""
        kept = self._kept
        if kept is None:
            return
        raw = kept.buffer.raw[: self.buckets[kept.index].data_bytes]
        if kept.new_file is None:
            self._store_file(kept.index, raw)
        else:
            self._write(raw, self.buckets[kept.index], file=kept.new_file).wait()
            kept.new_file.sync()
            self.bucket_files.install(Replacement(kept.index, kept.new_file, False))
            self.bytes_written += self.buckets[kept.index].file_bytes
        self._kept = None

    def discard_kept(self) -> None:
        """Drop the kept bucket's bytes unwritten (and the new file made for it): the whole
        state is about to be replaced around the engine (a checkpoint's load), and they
        would overwrite its bucket."""
        kept, self._kept = self._kept, None
        if kept is not None and kept.new_file is not None:
            self.bucket_files.drop(Replacement(kept.index, kept.new_file, False))

    def refill_host_cache(self) -> None:
        """Read the cached buckets back from their files (verified against the files'
        checksums): after the files were replaced around the engine (a checkpoint's load)."""
        self.engine.drain()
        self._sync_host_copies()
        for index, host in self.host_cache.items():
            self.engine.read(host, self.files[index], 0)
            self.bytes_read += self.buckets[index].file_bytes
        self.engine.drain()
        self._stale.clear()
