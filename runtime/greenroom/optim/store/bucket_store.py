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
import os
from typing import Callable, Iterator, Protocol, Sequence

import torch

from greenroom.errors import ConfigError
from greenroom.io.engine import STORE_RAW, StateFile, TransferEngine
from greenroom.optim import remainder
from greenroom.optim.moments import moment_codecs
from greenroom.optim.store.files import BucketFiles, DeviceBuffer, Replacement
from greenroom.optim.store.held import HeldBuckets, Kept
from greenroom.optim.store.hostcache import HostCopy, unpin
from greenroom.optim.store.layout import (
    DEFAULT_BUCKET_NUMEL,
    DEVICE_BUFFERS,
    FILE_PATTERN,
    Bucket,
    BucketState,
    Entry,
    Segment,
    build_buckets,
)


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


def _remove_created(files: list[StateFile]) -> None:
    """Unlink the files of ``files`` that their opening created: a failed setup or
    extension leaves no file it made."""
    for f in files:
        if f.created and os.path.exists(f.path):
            os.unlink(f.path)


class BucketStore(HeldBuckets):
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
        self.params = params
        self.reseeded_blocks = 0  # fingerprint blocks re-seeded from changed params (a device tensor once any ran)
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
        self._buffers: list[DeviceBuffer] = []
        self._kept: Kept | None = None  # optim.store.held Note [the last bucket stays]
        self._scratch: dict[str, torch.Tensor] = {}
        self.bytes_read = 0
        self.bytes_written = 0
        self.host_cache_budget = host_cache_bytes
        self.host_cache: dict[int, torch.Tensor] = {}  # bucket index -> its bytes (Note [host cache])
        self._stale: set[int] = set()  # cached buckets whose file lags behind the cache
        self._pinned = self.device.type == "cuda"
        self._copy_stream = None
        self.engine = TransferEngine(chunk_bytes)
        self.bucket_files = BucketFiles(self.buckets, directory, compression)
        try:
            for bucket in self.buckets:
                self.files.append(self.bucket_files.open_file(bucket))
            self._cache_buckets(range(len(self.buckets)))
        except BaseException:
            # A failed setup (no space for bucket 7, say) leaves no file it created.
            try:
                self.close()
            finally:
                _remove_created(self.files)
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
        return {
            "bucket_numel": self.bucket_numel,
            "moment_dtype": self.moment_dtype,
            "master_dtype": "fp32",
            "master_layout": self.master_layout,
            "moments": self.moments,
            "compression": self.compression.name if self.compression is not None else "none",
            "entries": [
                {"name": e.name, "shape": list(e.shape), "group": e.group, "master": e.master, "remainder": e.remainder}
                for e in self.entries
            ],
            "buckets": [
                {
                    "file": FILE_PATTERN.format(b.index),
                    "entries": list(b.entries),
                    "numel": b.numel,
                    "file_bytes": b.file_bytes,
                    "segments": {
                        name: None if seg is None else [seg.offset, seg.nbytes]
                        for name, seg in (
                            ("master", b.master),
                            ("fixups", b.fixups),
                            ("exp_avg", b.exp_avg),
                            ("exp_avg_sq", b.exp_avg_sq),
                        )
                    },
                }
                for b in self.buckets
            ],
        }

    @property
    def master_layout(self) -> str:
        """``remainder`` when any master is stored as a remainder (Note [remainder]), else ``fp32``."""
        return "remainder" if any(e.remainder for e in self.entries) else "fp32"

    # -- initialization -------------------------------------------------------------
    def initialize(self, source: Callable[[int], torch.Tensor] | Sequence[torch.Tensor]) -> None:
        """Fill every bucket: masters from ``source`` (entry index -> a tensor of the entry's
        shape, any dtype and device, read one at a time), moments zero. Bounded: one
        bucket at a time on the device, each file synced and its pages dropped (a cached
        bucket goes to its host memory instead, Note [host cache])."""
        get = source if callable(source) else source.__getitem__
        self._write_back_kept()
        buffer = self._buffer(0)
        for bucket, file in zip(self.buckets, self.files):
            raw = buffer.raw[: bucket.data_bytes]
            raw.zero_()  # zero bytes decode to zero moments in every codec
            if bucket.master is not None:
                master = (
                    self._scratch_tensor("master")[: bucket.numel]
                    if bucket.remainder
                    else self._master_view(raw, bucket)
                )
                for i, start in zip(bucket.entries, bucket.offsets):
                    n = self.entries[i].numel
                    master[start : start + n].copy_(get(i).detach().reshape(-1))
                if bucket.remainder:
                    self._encode_remainder(bucket, master, raw)
            self._store_bucket(bucket.index, raw)

    def overwrite(self, fill: Callable[[BucketState], None], indices: Sequence[int] | None = None) -> None:
        """Replace the contents of the buckets ``indices`` (default all), bounded like
        ``initialize``: each bucket starts zeroed on the device (zero master, zero
        moments), ``fill(state)`` sets what it has into the state's fp32 tensors, and the
        bucket is encoded, written to its file (or its host memory, Note [host cache]),
        synced and its pages dropped before the next one starts."""
        order = range(len(self.buckets)) if indices is None else indices
        self._write_back_kept()
        buffer = self._buffer(0)
        for index in order:
            bucket = self.buckets[index]
            raw = buffer.raw[: bucket.data_bytes]
            raw.zero_()  # zero bytes decode to zero moments in every codec
            state = self._decode(index, buffer)
            fill(state)
            self._encode(state, buffer)
            self._store_bucket(index, raw)

    def extend(self, entries: Sequence[Entry]) -> list[int]:
        """Append ``entries`` in new buckets of their own (``add_param_group``); returns
        the new buckets' indices. Their files are created but not filled: ``overwrite``
        them before streaming."""
        # Before any new file: a failed write-back of the kept bucket then leaves none behind.
        self._write_back_kept()
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
            _remove_created(files)  # as a failed setup does
            raise
        self.release_device_buffers()  # the buffers are sized for the largest bucket
        self.entries.extend(entries)
        self.buckets.extend(added)
        self.files.extend(files)
        self._cache_buckets([b.index for b in added])  # what budget is left, by the same rule
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
        from the same staging."""
        order = list(range(len(self.buckets))) if indices is None else list(indices)
        if not order:
            return
        linked = checkpoint is not None and checkpoint.links
        if self._kept is not None and self._kept.index not in order:
            self._write_back_kept()
        kept, self._kept = self._kept, None
        if kept is not None and linked and kept.new_file is not None:  # the checkpoint brings a new file
            self.bucket_files.drop(Replacement(kept.index, kept.new_file, False))
            kept.new_file = None
        order = self._order(order, kept.index if kept is not None else None)
        try:
            unkept = [i for i in order if i not in self.host_cache and (kept is None or i != kept.index)]
            fresh = {} if linked else self.bucket_files.new_files(unkept)
        except BaseException:
            self._kept = kept
            raise
        if kept is not None and kept.new_file is not None:
            fresh[kept.index] = kept.new_file
        buffers = self._ring(min(DEVICE_BUFFERS, len(order)), kept.buffer if kept is not None else None)
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
                state = self._decode(index, buffer)
                yield state
                self._encode(state, buffer)
                if k + 1 == len(order) and checkpoint is None and index not in self.host_cache:
                    last = Kept(index, buffer, fresh.pop(index, None))
                else:
                    self._submit_write(index, buffer, checkpoint, fresh)
                kept = None  # its bytes are this stream's now: written back, or kept again as ``last``
            failed = False
        finally:
            if kept is not None:  # failed or closed before its write-back began: its file never had them
                self._kept = kept
                fresh.pop(kept.index, None)
            try:
                self.engine.drain()
            except BaseException:
                failed = True
                raise
            finally:
                self._sync_host_copies()
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
                    self._kept = last

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
        if index in self.host_cache:
            return self._host_copy(raw, self.host_cache[index], to_device=True)
        self.bytes_read += bucket.file_bytes
        return self.engine.read(raw, self.files[index], 0)

    def _submit_write(
        self, index: int, buffer: DeviceBuffer, checkpoint: StepCheckpoint | None, fresh: dict[int, StateFile]
    ) -> None:
        """Start the write-back of bucket ``index`` from ``buffer``: to its cache, to a new
        file (the checkpoint's, or ``fresh``'s for a shared file), or in place; with a
        mirror file of the checkpoint's too where it writes twice."""
        bucket = self.buckets[index]
        raw = buffer.raw[: bucket.data_bytes]
        target = checkpoint.bucket_file(index) if checkpoint is not None else None
        if index in self.host_cache:
            self._stale.add(index)
            buffer.write = self._host_copy(self.host_cache[index], raw, to_device=False)
            return
        self.bytes_written += bucket.file_bytes
        mirror = None
        if target is not None and checkpoint.links and self.shared(index):
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

    def _decode(self, index: int, buffer: DeviceBuffer) -> BucketState:
        bucket = self.buckets[index]
        raw = buffer.raw
        if bucket.remainder:
            master = self._scratch_tensor("master")[: bucket.numel]
            params = [(start, self.params(i)) for i, start in zip(bucket.entries, bucket.offsets)]
            reseeded = remainder.decode(master, self._low_view(raw, bucket), self._fixups_view(raw, bucket), params)
            self.reseeded_blocks = reseeded + self.reseeded_blocks
        else:
            master = self._master_view(raw, bucket) if bucket.master is not None else None
        moments = []
        for codec, seg, key in (
            (self.avg_codec, bucket.exp_avg, "exp_avg"),
            (self.sq_codec, bucket.exp_avg_sq, "exp_avg_sq"),
        ):
            if seg is None:
                moments.append(None)
                continue
            seg_raw = raw[seg.offset : seg.offset + seg.nbytes]
            if codec.identity:
                moments.append(codec.view(seg_raw, bucket.numel))
            else:
                work = self._scratch_tensor(key)[: bucket.numel]
                codec.decode(seg_raw, work)
                moments.append(work)
        shapes = [self.entries[i].shape for i in bucket.entries]
        return BucketState(bucket=bucket, master=master, exp_avg=moments[0], exp_avg_sq=moments[1], _shapes=shapes)

    def _encode(self, state: BucketState, buffer: DeviceBuffer) -> None:
        bucket = state.bucket
        if bucket.remainder:
            self._encode_remainder(bucket, state.master, buffer.raw)
        for codec, seg, work in (
            (self.avg_codec, bucket.exp_avg, state.exp_avg),
            (self.sq_codec, bucket.exp_avg_sq, state.exp_avg_sq),
        ):
            if seg is not None and not codec.identity:
                codec.encode(work, buffer.raw[seg.offset : seg.offset + seg.nbytes])

    def _encode_remainder(self, bucket: Bucket, master: torch.Tensor, raw: torch.Tensor) -> None:
        remainder.encode(
            master,
            self._low_view(raw, bucket),
            self._fixups_view(raw, bucket),
            label=f"{self.path(bucket.index)}: bucket {bucket.index} of the optimizer state",
        )

    # -- buffers --------------------------------------------------------------------
    @staticmethod
    def _low_view(raw: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return raw[bucket.master.offset : bucket.master.offset + bucket.master.nbytes].view(torch.int16)

    @staticmethod
    def _fixups_view(raw: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return raw[bucket.fixups.offset : bucket.fixups.offset + bucket.fixups.nbytes]

    @staticmethod
    def _master_view(raw: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return raw[bucket.master.offset : bucket.master.offset + bucket.master.nbytes].view(torch.float32)

    def _buffer(self, i: int) -> DeviceBuffer:
        while len(self._buffers) <= i:
            self._buffers.append(DeviceBuffer(self.max_bucket_bytes, self.device))
        return self._buffers[i]

    def _ring(self, count: int, first: DeviceBuffer | None) -> list[DeviceBuffer]:
        """``count`` distinct device buffers for a stream, ``first`` (the kept bucket's) leading."""
        ring = [] if first is None else [first]
        i = 0
        while len(ring) < count:
            if self._buffer(i) is not first:
                ring.append(self._buffer(i))
            i += 1
        return ring

    def _scratch_tensor(self, key: str) -> torch.Tensor:
        if key not in self._scratch:
            numel = max(b.numel for b in self.buckets)
            self._scratch[key] = torch.empty(numel, dtype=torch.float32, device=self.device)
        return self._scratch[key]

    def device_bytes(self) -> int:
        """Device memory the store holds now (bucket buffers and scratch)."""
        return sum(s.raw.numel() for s in self._buffers) + sum(t.numel() * 4 for t in self._scratch.values())

    def release_device_buffers(self) -> None:
        """Write the kept bucket back, drain I/O and give the device buffers and scratch
        back (before the actor sleeps, say): then they hold nothing the files lack, and
        ``stream`` and ``initialize`` make them again when next needed."""
        self._write_back_kept()  # not under the finally: if it fails, its buffer is the state
        try:
            self.engine.drain()
        finally:
            self._sync_host_copies()
            self._buffers.clear()
            self._scratch.clear()

    def close(self, *, write_back: bool = True) -> None:
        """Flush the host cache and the kept bucket, drain I/O, close the files (they stay
        on disk, holding the state) and free the device buffers and the host cache. With
        ``write_back`` False the files keep what they hold and nothing new is written: for
        a store dropped unclosed, whose files no one reads again (see ``StreamedOptimizer.__del__``)."""
        if not write_back:
            self._stale.clear()
            self.discard_kept()
        try:
            try:
                self.flush()
            finally:
                self.release_device_buffers()
        finally:
            self.engine.close()
            for f in self.files:
                f.close()
            if self._pinned:
                for host in self.host_cache.values():
                    unpin(host)
            self.host_cache.clear()
            self._stale.clear()


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
