"""The bucket store: streamed optimizer state in per-bucket files, one bucket on the device.

This is the engine that ``StreamingAdam`` and the Megatron integration share. Public API::

    entries = [Entry(name="w", shape=(4096, 4096), group=0, master=True), ...]
    store = BucketStore(entries, directory, bucket_numel=100_000_000, moment_dtype="bf16",
                        device=torch.device("cuda"), chunk_bytes=256 << 20)
    store.initialize(lambda i: tensors[i])   # fill masters bucket by bucket, moments zero
    for state in store.stream():             # or store.stream([indices of the buckets needed])
        # state.bucket: the Bucket; state.master / exp_avg / exp_avg_sq: flat fp32 device
        # tensors of the bucket (master is None for a bucket of fp32 params that are their
        # own master); state.views(state.master) cuts one into per-entry views of the
        # entries' shapes. Update them in place; the iterator writes them back when the
        # loop asks for the next bucket.
        ...
    store.close()                            # drains I/O; the files stay (RankDir owns them)

- ``Entry``: one tensor's worth of state (name, shape, param group, whether an fp32
  master is stored). Buckets take consecutive entries of the same group and master kind
  up to ``bucket_numel`` elements; an entry larger than the cap is its own bucket.
- Each bucket is one preallocated file ``bucket-NNNNN.bin`` of 4 KiB-aligned segments
  ``[master | exp_avg | exp_avg_sq]`` (no master segment when ``master`` is false; for
  entries with ``remainder``, ``[low halves | fixups | exp_avg | exp_avg_sq]``, the master
  rebuilt from the params, ``greenroom.optim.remainder`` Note [remainder]),
  followed by the I/O engine's checksum table (``integrity`` Note [integrity]: kept in the
  file so that a checkpoint's copy carries it and a loaded one is verified on its first
  read); the moment segments use the ``codecs`` of ``moment_dtype``. ``store.layout()`` describes it
  all as JSON (the checkpoint manifest embeds it).
- ``stream()`` keeps ``DEVICE_BUFFERS`` (three) device buffers of one bucket file each:
  while the caller updates bucket i in one, the read of bucket i+1 fills another, and
  the write-back of bucket i-1 may still drain from the third; only the write-back of
  bucket i-2 must be over before the read of i+1 starts (all through the one
  ``TransferEngine``, whose staging is the chunk). Peak device memory is three bucket
  files plus, for narrow moments, one fp32 bucket of each moment: flat in the total
  state size.
- ``initialize()`` is bounded the same way: one bucket is assembled on the device,
  written to its final file, synced and its pages dropped before the next one starts;
  no copy of the whole state ever exists on the device or the host.
- Between steps the last bucket a step updated stays in its device buffer, and the next
  step starts on it: ``optim.store.held`` Note [the last bucket stays].
- ``host_cache_bytes`` (``--stream-optimizer-state-host-cache-gb``): ``optim.store.held``
  Note [host cache].
- A bucket file with another name (a checkpoint's link, a backup) is never written in
  place: ``optim.store.files`` Note [new inodes].
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Sequence

import torch

from greenroom.errors import ConfigError
from greenroom.io.engine import STORE_RAW, StateFile, TransferEngine
from greenroom.io.staging import stream_depth
from greenroom.optim.moments import moment_codecs
from greenroom.optim.store.buffers import DeviceBuffers
from greenroom.optim.store.files import BucketFiles, remove_created
from greenroom.optim.store.held import HeldBuckets
from greenroom.optim.store.hostcache import HostCache
from greenroom.optim.store.layout import (
    DEFAULT_BUCKET_NUMEL,
    FILE_PATTERN,
    Bucket,
    BucketState,
    Entry,
    Segment,
    build_buckets,
    describe,
    master_layout,
)
from greenroom.optim.store.stream import BucketStream, StepCheckpoint
from greenroom.optim.store.views import StateViews


class BucketStore:
    """Per-bucket state files for ``entries`` in ``directory``, streamed to ``device``.

    Args:
        entries: the tensors whose state streams, in order.
        directory: where the bucket files go (a claimed dir, ``greenroom.dirs.statedir``); created files
            are preallocated, and existing ones of the right size are reused in place.
        bucket_numel: element cap per bucket.
        moment_dtype: storage dtype of both moments (``greenroom.config.MOMENT_DTYPES``).
        device: where the state is updated (the params' device).
        chunk_bytes: staging host memory of the store's own ``TransferEngine``.
        compression: the frame codec of the bucket files (``greenroom.io.compression``), or
            None to store the bytes as they are.
        host_cache_bytes: host memory for whole buckets kept off the disk (Note [host
            cache]); 0, the default, keeps none.
        params: entry index -> the entry's bf16 param (on ``device``), read when a
            remainder bucket is decoded (Note [remainder]); needed only when an entry
            has ``remainder``.
        moments: moments per entry: 2 (Adam's, the default) or 1 (a momentum buffer in
            the ``exp_avg`` segment; ``exp_avg_sq`` is None).
    """

    def __init__(
        self,
        entries: Sequence[Entry],
        directory: str,
        *,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        moment_dtype: str = "fp32",
        device: torch.device | str = "cpu",
        chunk_bytes: int = 256 << 20,
        compression=None,
        host_cache_bytes: int = 0,
        moments: int = 2,
        params: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        if isinstance(host_cache_bytes, bool) or not isinstance(host_cache_bytes, int) or host_cache_bytes < 0:
            raise ConfigError(f"host_cache_bytes must be a non-negative integer, got {host_cache_bytes!r}")
        self.entries = list(entries)
        if params is None and any(e.remainder for e in self.entries):
            raise ConfigError("BucketStore: entries store their master as a remainder but no params were given")
        self.directory = directory
        self.bucket_numel = bucket_numel
        self.moment_dtype = moment_dtype
        self.device = torch.device(device)
        self.avg_codec, self.sq_codec = moment_codecs(moment_dtype)
        self.compression = compression
        self.moments = moments
        self.buckets = build_buckets(
            self.entries, bucket_numel, moment_dtype, compressed=compression is not None, moments=moments
        )
        self.buffers = DeviceBuffers(lambda: self.max_bucket_bytes, self.device)
        self.cache = HostCache(host_cache_bytes, self.device)  # optim.store.held Note [host cache]
        self.engine = TransferEngine(chunk_bytes, depth=stream_depth(chunk_bytes))
        self.bucket_files = BucketFiles(self.buckets, directory, compression)
        self.held = HeldBuckets(self.buckets, self.bucket_files, self.engine, self.cache, self._write)
        codecs = (self.avg_codec, self.sq_codec)
        self.views = StateViews(self.entries, self.buckets, params, codecs, self.device, self.bucket_files.path)
        self.bucket_stream = BucketStream(
            self.buckets, self.bucket_files, self.buffers, self.cache, self.held, self.views, self.engine, self._write
        )
        try:
            for bucket in self.buckets:
                self.files.append(self.bucket_files.open_file(bucket))
            self.cache.take(self.buckets)
        except BaseException:
            # A failed setup (no space for bucket 7, say) leaves no file it created.
            try:
                self.close()
            finally:
                remove_created(self.files)
            raise

    # The bucket files are an object of their own (``files.BucketFiles``); these are its
    # public face on the store, which callers (checkpoints, state dicts, benches) use.
    @property
    def files(self) -> list[StateFile]:
        """Each bucket's live file, by bucket index."""
        return self.bucket_files.files

    def path(self, index: int) -> str:
        return self.bucket_files.path(index)

    def shared(self, index: int) -> bool:
        return self.bucket_files.shared(index)

    def open_copy(self, index: int, path: str) -> StateFile:
        return self.bucket_files.open_copy(index, path)

    def open_existing(self, index: int, path: str) -> StateFile:
        return self.bucket_files.open_existing(index, path)

    def disk_bytes(self, way: str) -> int:
        return self.bucket_files.disk_bytes(way)

    def replace_file(self, index: int, path: str) -> None:
        self.bucket_files.replace_file(index, path)

    def link_file(self, index: int, source: str) -> None:
        self.bucket_files.link_file(index, source)

    # The host cache and the kept bucket are objects of their own too (``hostcache.HostCache``,
    # ``held.HeldBuckets``, Notes [host cache] and [the last bucket stays]); their public face:
    @property
    def host_cache(self) -> dict[int, torch.Tensor]:
        """Bucket index -> its bytes, for the cached buckets."""
        return self.cache.tensors

    @property
    def host_cache_bytes(self) -> int:
        return self.cache.nbytes

    @property
    def disk_bytes_per_step(self) -> int:
        return self.held.disk_bytes_per_step

    @property
    def kept_bytes(self) -> int:
        return self.held.kept_bytes

    @property
    def reseeded_blocks(self):
        """Fingerprint blocks re-seeded from changed params (Note [remainder]; a device tensor once any ran)."""
        return self.views.reseeded_blocks

    @property
    def bytes_read(self) -> int:
        """Bytes of bucket files read (``file_bytes`` each; ``disk_bytes``: what reached the disk)."""
        return self.bucket_stream.bytes_read + self.held.bytes_read

    @property
    def bytes_written(self) -> int:
        """Bytes of bucket files written (``file_bytes`` each; ``disk_bytes``: what reached the disk)."""
        return self.bucket_stream.bytes_written + self.held.bytes_written

    def write_cached(self, index: int, file: StateFile):
        return self.held.write_cached(index, file)

    def flush(self) -> None:
        self.held.flush()

    def discard_kept(self) -> None:
        self.held.discard_kept()

    def refill_host_cache(self) -> None:
        self.held.refill()

    def _write(
        self, raw: torch.Tensor, bucket: Bucket, *, file: StateFile | None = None, mirror: StateFile | None = None
    ):
        """Write a bucket's bytes to its file (or ``file``), and to ``mirror`` too (an
        in-step checkpoint's copy), telling a codec each segment's element size."""
        # A master's low halves are noise to a codec (Note [remainder]): stored raw, untried.
        segments = (
            (bucket.master, STORE_RAW if bucket.remainder else 4),
            (bucket.fixups, 8),
            (bucket.exp_avg, self.avg_codec.dtype.itemsize),
            (bucket.exp_avg_sq, self.sq_codec.dtype.itemsize),
        )
        sizes = [(seg.offset, size) for seg, size in segments if seg is not None]
        return self.engine.write(raw, file or self.files[bucket.index], 0, element_sizes=tuple(sizes), mirror=mirror)

    # -- facts ----------------------------------------------------------------------
    @property
    def state_bytes(self) -> int:
        """Bytes of all bucket files (what a step reads and writes when no bucket is kept)."""
        return sum(b.file_bytes for b in self.buckets)

    @property
    def max_bucket_bytes(self) -> int:
        """The largest bucket's segments: the size of a device buffer."""
        return max((b.data_bytes for b in self.buckets), default=0)

    def layout(self) -> dict:
        """The layout as JSON: what a checkpoint must match to be read back."""
        return describe(
            self.entries,
            self.buckets,
            bucket_numel=self.bucket_numel,
            moment_dtype=self.moment_dtype,
            moments=self.moments,
            compression=self.compression.name if self.compression is not None else "none",
        )

    @property
    def master_layout(self) -> str:
        """``remainder`` when any master is stored as a remainder (Note [remainder]), else ``fp32``."""
        return master_layout(self.entries)

    # -- initialization -------------------------------------------------------------
    def initialize(self, source: Callable[[int], torch.Tensor] | Sequence[torch.Tensor]) -> None:
        """Fill every bucket: masters from ``source`` (entry index -> a tensor of the entry's
        shape, any dtype and device, read one at a time), moments zero. Bounded: one
        bucket at a time on the device, each file synced and its pages dropped (a cached
        bucket goes to its host memory instead, Note [host cache])."""
        get = source if callable(source) else source.__getitem__
        self.held.write_back_kept()
        buffer = self.buffers.get(0)
        for bucket, file in zip(self.buckets, self.files):
            raw = buffer.raw[: bucket.data_bytes]
            raw.zero_()  # zero bytes decode to zero moments in every codec
            self.views.fill_masters(bucket, raw, get)
            self.held.store_bucket(bucket.index, raw)

    def overwrite(self, fill: Callable[[BucketState], None], indices: Sequence[int] | None = None) -> None:
        """Replace the contents of the buckets ``indices`` (default all), bounded like
        ``initialize``: each bucket starts zeroed on the device (zero master, zero
        moments), ``fill(state)`` sets what it has into the state's fp32 tensors, and the
        bucket is encoded, written to its file (or its host memory, Note [host cache]),
        synced and its pages dropped before the next one starts."""
        order = range(len(self.buckets)) if indices is None else indices
        self.held.write_back_kept()
        buffer = self.buffers.get(0)
        for index in order:
            bucket = self.buckets[index]
            raw = buffer.raw[: bucket.data_bytes]
            raw.zero_()  # zero bytes decode to zero moments in every codec
            state = self.views.decode(index, buffer.raw)
            fill(state)
            self.views.encode(state, buffer.raw)
            self.held.store_bucket(index, raw)

    def extend(self, entries: Sequence[Entry]) -> list[int]:
        """Append ``entries`` in new buckets of their own (``add_param_group``); returns
        the new buckets' indices. Their files are created but not filled: ``overwrite``
        them before streaming."""
        # Before any new file: a failed write-back of the kept bucket then leaves none behind.
        self.held.write_back_kept()
        first_entry, first_bucket = len(self.entries), len(self.buckets)
        added = [
            dataclasses.replace(b, index=first_bucket + b.index, entries=tuple(first_entry + i for i in b.entries))
            for b in build_buckets(
                entries,
                self.bucket_numel,
                self.moment_dtype,
                compressed=self.compression is not None,
                moments=self.moments,
            )
        ]
        files = []
        try:
            for bucket in added:
                files.append(self.bucket_files.open_file(bucket))
        except BaseException:
            for f in files:
                f.close()
            remove_created(files)  # as a failed setup does
            raise
        self.release_device_buffers()  # the buffers are sized for the largest bucket
        self.entries.extend(entries)
        self.buckets.extend(added)
        self.files.extend(files)
        self.cache.take(added)  # what budget is left, by the same rule
        return [b.index for b in added]

    # -- the step -------------------------------------------------------------------
    def stream(
        self, indices: Sequence[int] | None = None, *, checkpoint: StepCheckpoint | None = None
    ) -> Iterator[BucketState]:
        """Yield the buckets ``indices`` (default all) on the device, reading ahead one and
        writing back behind: the bucket the last stream kept first, unread, and last the
        one this stream keeps, unwritten (``optim.store.held`` Note [the last bucket
        stays]); the other writes are drained when it finishes, and every bucket written
        to a new file has its live name (``optim.store.files`` Note [new inodes]).
        ``checkpoint``: an in-step checkpoint (``optim.checkpoint.instep``) that each written-back
        bucket also goes to: by a link (to the live file once written in place, or, for
        a shared one, to the new file the checkpoint hands out), or by a second write
        from the same staging. Run by the store's ``optim.store.stream.BucketStream``."""
        return self.bucket_stream.run(indices, checkpoint=checkpoint)

    # -- buffers --------------------------------------------------------------------
    def device_bytes(self) -> int:
        """Device memory the store holds now (bucket buffers and scratch)."""
        return self.buffers.nbytes + self.views.scratch_bytes

    def release_device_buffers(self) -> None:
        """Write the kept bucket back, drain I/O and give the device buffers and scratch
        back (before the actor sleeps, say): then they hold nothing the files lack, and
        ``stream`` and ``initialize`` make them again when next needed."""
        self.held.write_back_kept()  # not under the finally: if it fails, its buffer is the state
        try:
            self.engine.drain()
        finally:
            self.cache.sync()
            self.buffers.release()
            self.views.release()

    def close(self, *, write_back: bool = True) -> None:
        """Flush the host cache and the kept bucket, drain I/O, close the files (they stay
        on disk, holding the state) and free the device buffers and the host cache. With
        ``write_back`` False the files keep what they hold and nothing new is written: for
        a store dropped unclosed, whose files no one reads again (see ``StreamedOptimizer.__del__``)."""
        if not write_back:
            self.held.discard()
        try:
            try:
                self.flush()
            finally:
                self.release_device_buffers()
        finally:
            self.engine.close()
            for f in self.files:
                f.close()
            self.cache.free()


__all__ = [
    "Bucket",
    "BucketState",
    "BucketStore",
    "DEFAULT_BUCKET_NUMEL",
    "Entry",
    "FILE_PATTERN",
    "Segment",
    "build_buckets",
]
