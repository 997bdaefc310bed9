"""The bucket store: streamed optimizer state in per-bucket files, one bucket on the device.

This is the engine that ``StreamingAdam`` and the Megatron integration share. Public API::

    entries = [Entry(name="w", shape=(4096, 4096), group=0, master=True), ...]
    store = BucketStore(entries, directory, bucket_numel=200_000_000, moment_dtype="bf16",
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
  followed by the I/O engine's checksum table (``diskio`` Note [integrity]: kept in the
  file so that a checkpoint's copy carries it and a loaded one is verified on its first
  read); the moment segments use the ``codecs`` of ``moment_dtype``. ``store.layout()`` describes it
  all as JSON (the checkpoint manifest embeds it).
- ``stream()`` keeps two device buffers of one bucket file each: while the caller updates
  bucket i in one, the read of bucket i+1 fills the other, and the write-back of bucket
  i-1 drains before that read starts (both through the one ``TransferEngine``, whose
  staging is the chunk). Peak device memory is two bucket files plus, for narrow
  moments, one fp32 bucket of each moment: flat in the total state size.
- ``initialize()`` is bounded the same way: one bucket is assembled on the device,
  written to its final file, synced and its pages dropped before the next one starts;
  no copy of the whole state ever exists on the device or the host.
- ``host_cache_bytes`` (``--stream-optimizer-state-host-cache-gb``): see Note [host cache].

Note [new inodes]: a bucket is written in place only while its file's inode has one
name (``fstat``'s ``st_nlink``, checked on the open fd: a checkpoint's link and a user's
``cp -l`` backup count alike; ``diskio`` Note [shared inodes]). A bucket whose file is
shared is written to a new file beside it (``bucket-NNNNN.bin.new``, preallocated: all
of a step's new files are made before its first write, so running out of space fails
before any bucket changed), which is renamed over the live name once written; the
other names keep the old inode, untouched. A step that writes a checkpoint by links
(``optim.instep``) hands each bucket a new file in the checkpoint's staging dir
instead: once written, the live name becomes a link to it (``.new`` then rename), so the
checkpoint holds the step's result at the price of no extra byte, and the next step
writes those buckets to new inodes again. Either way a live name always names a whole
bucket (the old one or the new one, each with its own table), and a kill leaves every
other name as it was.

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
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

import torch

from greenroom.diskio import STORE_RAW, StateFile, TransferEngine, align_up
from greenroom.errors import ConfigError, StorageError
from greenroom.faults import kill_point
from greenroom.fs import human_bytes
from greenroom.optim import remainder
from greenroom.optim.hardlink import NEW_SUFFIX, link_over
from greenroom.optim.codecs import moment_codecs

DEFAULT_BUCKET_NUMEL = 200_000_000
FILE_PATTERN = "bucket-{:05d}.bin"


class StepCheckpoint(Protocol):
    """What ``BucketStore.stream`` asks of the checkpoint a step writes (``optim.instep``)."""

    links: bool
    """True: each bucket is written to the checkpoint's new file, which the live name then
    links; False: each is written in place (or to a new inode) and to the checkpoint's
    file too, a second write from the same staging."""

    def bucket_file(self, index: int) -> StateFile | None:
        """The checkpoint's file of bucket ``index`` (None: not through the stream)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    """One tensor whose optimizer state streams."""

    name: str
    """A stable name (the param's name, or ``group.index``): recorded in the layout."""

    shape: tuple[int, ...]
    """The (local shard's) shape; the state has this many elements."""

    group: int = 0
    """Param group index: a bucket never mixes groups (one lr and weight decay each)."""

    master: bool = True
    """Store an fp32 master copy (16-bit params); False when the fp32 param is its own."""

    remainder: bool = False
    """Store the master as its low 16 bits beside the bf16 param (``greenroom.optim.remainder``
    Note [remainder]): 2 B/param instead of 4. Only for masters of bf16 params; the store
    then reads the params through its ``params`` callback to rebuild the masters."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True, slots=True)
class Segment:
    """A 4 KiB-aligned range of a bucket file."""

    offset: int
    """Byte offset in the file (a multiple of 4096)."""

    nbytes: int
    """Bytes of data (the codec's size, before alignment)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Bucket:
    """Consecutive entries whose state lives in one file."""

    index: int
    """Position in the store; the file is ``FILE_PATTERN.format(index)``."""

    entries: tuple[int, ...]
    """Indices into the store's entries, in order."""

    numel: int
    """Total elements of the entries."""

    master: Segment | None
    """The fp32 master segment (or, for a remainder bucket, its low halves), or None for
    fp32 params that are their own master."""

    exp_avg: Segment
    """First moment."""

    exp_avg_sq: Segment | None
    """Second moment; None in a store of one moment (Muon's momentum buffer)."""

    data_bytes: int
    """Bytes of the segments (aligned): what a step reads and writes back."""

    file_bytes: int
    """Size of the file: the segments and the checksum table after them."""

    offsets: tuple[int, ...] = field(default=())
    """Element offset of each entry within the bucket's flat tensors."""

    fixups: Segment | None = None
    """A remainder bucket's fingerprints and exceptions (Note [remainder]), else None."""

    @property
    def remainder(self) -> bool:
        return self.fixups is not None


@dataclass(eq=False, slots=True)
class BucketState:
    """One bucket's state on the device, as ``BucketStore.stream`` yields it."""

    bucket: Bucket
    master: torch.Tensor | None
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor | None
    _shapes: list[tuple[int, ...]]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-entry views of one of the bucket's flat tensors, in the entries' shapes."""
        out = []
        for start, shape in zip(self.bucket.offsets, self._shapes):
            n = math.prod(shape)
            out.append(flat[start:start + n].view(shape))
        return out


def build_buckets(entries: Sequence[Entry], bucket_numel: int, moment_dtype: str, *,
                  compressed: bool = False, moments: int = 2) -> list[Bucket]:
    """Group consecutive entries (same group and master kind) into buckets of at most
    ``bucket_numel`` elements; an entry larger than the cap gets a bucket of its own.
    ``compressed``: the files' table also records the bytes each frame stored.
    ``moments``: 2 (Adam's ``exp_avg`` and ``exp_avg_sq``) or 1 (``exp_avg`` only: a
    momentum buffer, as Muon keeps)."""
    if moments not in (1, 2):
        raise ConfigError(f"moments must be 1 or 2, got {moments!r}")
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel <= 0:
        raise ConfigError(f"bucket_numel must be a positive integer, got {bucket_numel!r}")
    avg_codec, sq_codec = moment_codecs(moment_dtype)
    groups: list[list[int]] = []
    current: list[int] = []
    current_numel = 0
    for i, entry in enumerate(entries):
        if entry.numel == 0:
            raise ConfigError(f"entry {entry.name!r} has no elements: leave it out of the store")
        if entry.remainder and not entry.master:
            raise ConfigError(f"entry {entry.name!r}: a remainder needs a master (remainder=True, master=False)")
        kind = (entry.group, entry.master, entry.remainder)
        first = entries[current[0]] if current else None
        same_kind = first is not None and (first.group, first.master, first.remainder) == kind
        if current and (not same_kind or current_numel + entry.numel > bucket_numel):
            groups.append(current)
            current, current_numel = [], 0
        current.append(i)
        current_numel += entry.numel
    if current:
        groups.append(current)
    buckets = []
    for index, members in enumerate(groups):
        offsets, numel = [], 0
        for i in members:
            offsets.append(numel)
            numel += entries[i].numel
        cursor = 0
        master = fixups = None
        if entries[members[0]].remainder:
            master = Segment(offset=0, nbytes=numel * 2)
            fixups = Segment(offset=align_up(master.nbytes), nbytes=remainder.fixup_bytes(numel))
            cursor = align_up(fixups.offset + fixups.nbytes)
        elif entries[members[0]].master:
            master = Segment(offset=0, nbytes=numel * 4)
            cursor = align_up(master.nbytes)
        exp_avg = Segment(offset=cursor, nbytes=avg_codec.nbytes(numel))
        cursor = align_up(cursor + exp_avg.nbytes)
        exp_avg_sq = None
        if moments == 2:
            exp_avg_sq = Segment(offset=cursor, nbytes=sq_codec.nbytes(numel))
            cursor = align_up(cursor + exp_avg_sq.nbytes)
        buckets.append(Bucket(index=index, entries=tuple(members), numel=numel, master=master,
                              exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, data_bytes=cursor,
                              file_bytes=StateFile.file_bytes(cursor, checksums="file", compressed=compressed),
                              offsets=tuple(offsets), fixups=fixups))
    return buckets


class _DeviceBuffer:
    """A device buffer holding one bucket file's bytes, the write still reading it, and
    the new file that write fills, to be installed once it is over (Note [new inodes])."""

    __slots__ = ("raw", "write", "replacing")

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.write = None
        self.replacing: _Replacement | None = None


@dataclass(eq=False, slots=True)
class _Replacement:
    """A new file that bucket ``index`` is being written to, to take its live name once
    written: ``linked`` when the file lives elsewhere (a checkpoint's staging dir) and
    the live name gets a link to it, else it is a temporary name beside the live one."""

    index: int
    file: StateFile
    linked: bool


class _HostCopy:
    """A copy between a device buffer and the host cache, as ``stream`` waits for it
    (the engine's ``Transfer`` for a file). A read lets the caller's stream go on once
    the bytes are in; a write-back blocks the host until the device buffer is free."""

    __slots__ = ("event", "stream")

    def __init__(self, event=None, stream=None) -> None:
        self.event, self.stream = event, stream  # None: a synchronous (CPU) copy, already over

    def wait(self) -> None:
        if self.event is None:
            return
        if self.stream is not None:
            self.stream.wait_event(self.event)
        else:
            self.event.synchronize()


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as torch registers


def _host_memory(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of page-aligned anonymous host memory as a uint8 tensor, registered with
    CUDA (pinned) when ``pin``. Not torch's pinned allocator, which rounds each
    allocation up to a power of two (a 2.4 GB bucket would take 4.3 GB); and not
    torch-owned, so actor offload on a CPU device leaves it in place, as it does the
    engine's own memory."""
    memory = mmap.mmap(-1, nbytes)
    tensor = torch.frombuffer(memory, dtype=torch.uint8)
    if pin:
        code = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, _HOST_REGISTER_PORTABLE))
        if code != 0:
            raise StorageError(f"--stream-optimizer-state-host-cache-gb: pinning {human_bytes(nbytes)} of host memory "
                               f"failed (CUDA error {code}); use a smaller host cache")
    return tensor


def _unpin(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


class BucketStore:
    """Per-bucket state files for ``entries`` in ``directory``, streamed to ``device``.

    Args:
        entries: the tensors whose state streams, in order.
        directory: where the bucket files go (a claimed dir, ``greenroom.statedir``); created files
            are preallocated, and existing ones of the right size are reused in place.
        bucket_numel: element cap per bucket.
        moment_dtype: storage dtype of both moments (``greenroom.config.MOMENT_DTYPES``).
        device: where the state is updated (the params' device).
        chunk_bytes: staging host memory of the store's own ``TransferEngine``.
        compression: the frame codec of the bucket files (``greenroom.compression``), or
            None to store the bytes as they are.
        host_cache_bytes: host memory for whole buckets kept off the disk (Note [host
            cache]); 0, the default, keeps none.
        params: entry index -> the entry's bf16 param (on ``device``), read when a
            remainder bucket is decoded (Note [remainder]); needed only when an entry
            has ``remainder``.
        moments: moments per entry: 2 (Adam's, the default) or 1 (a momentum buffer in
            the ``exp_avg`` segment; ``exp_avg_sq`` is None).
    """

    def __init__(self, entries: Sequence[Entry], directory: str, *, bucket_numel: int = DEFAULT_BUCKET_NUMEL,
                 moment_dtype: str = "fp32", device: torch.device | str = "cpu", chunk_bytes: int = 256 << 20,
                 compression=None, host_cache_bytes: int = 0, moments: int = 2,
                 params: Callable[[int], torch.Tensor] | None = None) -> None:
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
        self.buckets = build_buckets(self.entries, bucket_numel, moment_dtype, compressed=compression is not None,
                                     moments=moments)
        self._buffers: list[_DeviceBuffer] = []
        self._scratch: dict[str, torch.Tensor] = {}
        self.bytes_read = 0
        self.bytes_written = 0
        self._retired_bytes_read = 0  # disk bytes of the files that new inodes replaced
        self._retired_bytes_written = 0
        self.host_cache_budget = host_cache_bytes
        self.host_cache: dict[int, torch.Tensor] = {}  # bucket index -> its bytes (Note [host cache])
        self._stale: set[int] = set()  # cached buckets whose file lags behind the cache
        self._pinned = self.device.type == "cuda"
        self._copy_stream = None
        self.engine = TransferEngine(chunk_bytes)
        self.files: list[StateFile] = []
        try:
            for bucket in self.buckets:
                self.files.append(self._open_file(bucket))
            self._cache_buckets(range(len(self.buckets)))
        except BaseException:
            # A failed setup (no space for bucket 7, say) leaves no file it created.
            try:
                self.close()
            finally:
                for f in self.files:
                    if f.created and os.path.exists(f.path):
                        os.unlink(f.path)
            raise

    def _open_file(self, bucket: Bucket) -> StateFile:
        return StateFile(self.path(bucket.index), bucket.data_bytes, checksums="file", compression=self.compression,
                         label=f"bucket {bucket.index} of the optimizer state")

    def _write(self, raw: torch.Tensor, bucket: Bucket, *, file: StateFile | None = None,
               mirror: StateFile | None = None):
        """Write a bucket's bytes to its file (or ``file``), and to ``mirror`` too (an
        in-step checkpoint's copy), telling a codec each segment's element size."""
        # A master's low halves are noise to a codec (Note [remainder]): stored raw, untried.
        segments = ((bucket.master, STORE_RAW if bucket.remainder else 4), (bucket.fixups, 8),
                    (bucket.exp_avg, self.avg_codec.dtype.itemsize), (bucket.exp_avg_sq, self.sq_codec.dtype.itemsize))
        sizes = [(seg.offset, size) for seg, size in segments if seg is not None]
        return self.engine.write(raw, file or self.files[bucket.index], 0, element_sizes=tuple(sizes), mirror=mirror)

    def open_copy(self, index: int, path: str) -> StateFile:
        """A preallocated file at ``path`` of bucket ``index``'s layout, to mirror its
        writes into (``stream(mirror=...)``) or write a cached bucket to."""
        bucket = self.buckets[index]
        return StateFile(path, bucket.data_bytes, checksums="file", compression=self.compression,
                         label=f"bucket {bucket.index} of a checkpoint of the optimizer state")

    def open_existing(self, index: int, path: str) -> StateFile:
        """Bucket ``index``'s layout over an existing file at ``path`` (a checkpoint's copy),
        its length checked, to read its table or verify it."""
        bucket = self.buckets[index]
        return StateFile(path, bucket.data_bytes, create=False, checksums="file", compression=self.compression,
                         label=f"bucket {bucket.index} of a checkpoint of the optimizer state")

    def write_cached(self, index: int, file: StateFile):
        """Write cached bucket ``index``'s host bytes to ``file`` (no read: the cache is the state)."""
        return self._write(self.host_cache[index], self.buckets[index], file=file)

    # -- facts ----------------------------------------------------------------------
    def disk_bytes(self, way: str) -> int:
        """Bytes ``read`` from or ``written`` to the bucket files since they were opened:
        the state's bytes, less what compression saved."""
        retired = self._retired_bytes_read if way == "read" else self._retired_bytes_written
        return retired + sum(getattr(f, f"disk_bytes_{way}") for f in self.files)

    def path(self, index: int) -> str:
        return os.path.join(self.directory, FILE_PATTERN.format(index))

    @property
    def state_bytes(self) -> int:
        """Bytes of all bucket files (what one full step reads, and writes)."""
        return sum(b.file_bytes for b in self.buckets)

    @property
    def host_cache_bytes(self) -> int:
        """Host memory the cached buckets take (at most ``host_cache_budget``)."""
        return sum(t.numel() for t in self.host_cache.values())

    @property
    def disk_bytes_per_step(self) -> int:
        """Bytes of the files a full step reads (and writes back): the uncached buckets'."""
        return sum(b.file_bytes for b in self.buckets if b.index not in self.host_cache)

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
            "entries": [{"name": e.name, "shape": list(e.shape), "group": e.group, "master": e.master,
                         "remainder": e.remainder} for e in self.entries],
            "buckets": [{"file": FILE_PATTERN.format(b.index), "entries": list(b.entries), "numel": b.numel,
                         "file_bytes": b.file_bytes,
                         "segments": {name: None if seg is None else [seg.offset, seg.nbytes]
                                      for name, seg in (("master", b.master), ("fixups", b.fixups),
                                                        ("exp_avg", b.exp_avg), ("exp_avg_sq", b.exp_avg_sq))}}
                        for b in self.buckets],
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
        buffer = self._buffer(0)
        for bucket, file in zip(self.buckets, self.files):
            raw = buffer.raw[:bucket.data_bytes]
            raw.zero_()  # zero bytes decode to zero moments in every codec
            if bucket.master is not None:
                master = (self._scratch_tensor("master")[:bucket.numel] if bucket.remainder
                          else self._master_view(raw, bucket))
                for i, start in zip(bucket.entries, bucket.offsets):
                    n = self.entries[i].numel
                    master[start:start + n].copy_(get(i).detach().reshape(-1))
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
        buffer = self._buffer(0)
        for index in order:
            bucket = self.buckets[index]
            raw = buffer.raw[:bucket.data_bytes]
            raw.zero_()  # zero bytes decode to zero moments in every codec
            state = self._decode(index, buffer)
            fill(state)
            self._encode(state, buffer)
            self._store_bucket(index, raw)

    def _store_bucket(self, index: int, raw: torch.Tensor) -> None:
        """Put a whole bucket's bytes where it lives: its cache (the file goes stale), or
        its file (written, synced, its pages dropped)."""
        host = self.host_cache.get(index)
        if host is not None:
            host.copy_(raw)
            self._stale.add(index)
            return
        self._store_file(index, raw)

    def extend(self, entries: Sequence[Entry]) -> list[int]:
        """Append ``entries`` in new buckets of their own (``add_param_group``); returns
        the new buckets' indices. Their files are created but not filled: ``overwrite``
        them before streaming."""
        first_entry, first_bucket = len(self.entries), len(self.buckets)
        added = [dataclasses.replace(b, index=first_bucket + b.index,
                                     entries=tuple(first_entry + i for i in b.entries))
                 for b in build_buckets(entries, self.bucket_numel, self.moment_dtype,
                                       compressed=self.compression is not None, moments=self.moments)]
        files = []
        try:
            for bucket in added:
                files.append(self._open_file(bucket))
        except BaseException:
            for f in files:
                f.close()
            raise
        self.release_device_buffers()  # the buffers are sized for the largest bucket
        self.entries.extend(entries)
        self.buckets.extend(added)
        self.files.extend(files)
        self._cache_buckets([b.index for b in added])  # what budget is left, by the same rule
        return [b.index for b in added]

    def _cache_buckets(self, indices: Sequence[int]) -> None:
        """Give the buckets ``indices`` host memory while the budget lasts (Note [host cache])."""
        left = self.host_cache_budget - self.host_cache_bytes
        for index in indices:
            nbytes = self.buckets[index].data_bytes
            if nbytes <= left:
                self.host_cache[index] = _host_memory(nbytes, self._pinned)
                left -= nbytes

    # -- the step -------------------------------------------------------------------
    def stream(self, indices: Sequence[int] | None = None, *,
               checkpoint: StepCheckpoint | None = None) -> Iterator[BucketState]:
        """Yield the buckets ``indices`` (default all, in order) on the device, reading
        ahead one and writing back behind; all writes are drained when it finishes, and
        every bucket written to a new file has its live name (Note [new inodes]).
        ``checkpoint``: an in-step checkpoint (``optim.instep``) that each written-back
        bucket also goes to: by a link to the new file it hands out, or by a second
        write from the same staging."""
        order = list(range(len(self.buckets))) if indices is None else list(indices)
        if not order:
            return
        linked = checkpoint is not None and checkpoint.links
        fresh = {} if linked else self._new_files([i for i in order if i not in self.host_cache])
        buffers = [self._buffer(0), self._buffer(1)]
        pending = self._submit_read(order[0], buffers[0])
        failed = True
        try:
            for k, index in enumerate(order):
                buffer = buffers[k % 2]
                pending.wait()
                if k + 1 < len(order):
                    ahead = buffers[(k + 1) % 2]
                    self._finish_write(ahead)  # bucket k-1 leaves that buffer before k+1 comes in
                    pending = self._submit_read(order[k + 1], ahead)
                state = self._decode(index, buffer)
                yield state
                self._encode(state, buffer)
                self._submit_write(index, buffer, checkpoint, fresh)
            failed = False
        finally:
            try:
                self.engine.drain()
            except BaseException:
                failed = True
                raise
            finally:
                self._sync_host_copies()
                for buffer in buffers:
                    buffer.write = None
                    replacing, buffer.replacing = buffer.replacing, None
                    if replacing is not None and not failed:
                        self._install(replacing)
                    elif replacing is not None:
                        self._drop(replacing)
                for index, f in fresh.items():  # made for a bucket the stream never wrote
                    self._drop(_Replacement(index, f, False))

    def _finish_write(self, buffer: _DeviceBuffer) -> None:
        """Wait for the write still reading ``buffer``; give its new file the live name."""
        if buffer.write is not None:
            write, buffer.write = buffer.write, None
            write.wait()
        replacing, buffer.replacing = buffer.replacing, None
        if replacing is not None:
            self._install(replacing)

    # -- new inodes for shared files (Note [new inodes]) ------------------------------
    def shared(self, index: int) -> bool:
        """Whether bucket ``index``'s live file has another name (a checkpoint, a backup)."""
        return os.fstat(self.files[index].fd).st_nlink > 1

    def _new_files(self, indices: Sequence[int]) -> dict[int, StateFile]:
        """A preallocated new file beside the live one for each of the buckets ``indices``
        whose live file is shared: all made before any is written."""
        made: dict[int, StateFile] = {}
        try:
            for index in indices:
                if index not in made and self.shared(index):
                    made[index] = self._open_at(index, self.path(index) + NEW_SUFFIX)
        except BaseException:
            for index, f in made.items():
                self._drop(_Replacement(index, f, False))
            raise
        return made

    def _open_at(self, index: int, path: str) -> StateFile:
        bucket = self.buckets[index]
        if os.path.lexists(path):
            os.unlink(path)  # a .new of ours left by a write that failed
        return StateFile(path, bucket.data_bytes, checksums="file", compression=self.compression,
                         label=f"bucket {bucket.index} of the optimizer state")

    def _install(self, replacing: _Replacement) -> None:
        """Give a fully written new file bucket ``replacing.index``'s live name (atomic:
        the name names the old bucket or the new one, never a part of either)."""
        index, live = replacing.index, self.path(replacing.index)
        old = self.files[index]
        if replacing.linked:
            link_over(replacing.file.path, live)
            self._retired_bytes_written += replacing.file.disk_bytes_written
            new = self._reopen(index)
        else:
            os.rename(replacing.file.path, live)
            replacing.file.path = live
            new = replacing.file
        self.files[index] = new
        self._retire(old)
        kill_point("bucket-replaced")

    def _reopen(self, index: int) -> StateFile:
        """The live file of bucket ``index`` opened again (after its name got a new inode)."""
        bucket = self.buckets[index]
        return StateFile(self.path(index), bucket.data_bytes, create=False, checksums="file",
                         compression=self.compression, label=f"bucket {bucket.index} of the optimizer state")

    def replace_file(self, index: int, path: str) -> None:
        """Make the live name of bucket ``index`` name the file at ``path`` (a new inode
        written around the engine, a checkpoint's copy or clone) and open it."""
        os.rename(path, self.path(index))
        old = self.files[index]
        self.files[index] = self._reopen(index)
        self._retire(old)

    def link_file(self, index: int, source: str) -> None:
        """Make the live name of bucket ``index`` a link to ``source`` (a checkpoint's file,
        loaded without a byte moved; the next write gives the bucket a new inode)."""
        link_over(source, self.path(index))
        old = self.files[index]
        self.files[index] = self._reopen(index)
        self._retire(old)

    def _retire(self, old: StateFile) -> None:
        self._retired_bytes_read += old.disk_bytes_read
        self._retired_bytes_written += old.disk_bytes_written
        old.close()

    def _drop(self, replacing: _Replacement) -> None:
        """Forget a new file that will not be installed: closed, and removed if it is ours."""
        replacing.file.close()
        if not replacing.linked and os.path.lexists(replacing.file.path):
            os.unlink(replacing.file.path)

    def _submit_read(self, index: int, buffer: _DeviceBuffer):
        bucket = self.buckets[index]
        raw = buffer.raw[:bucket.data_bytes]
        if index in self.host_cache:
            return self._host_copy(raw, self.host_cache[index], to_device=True)
        self.bytes_read += bucket.file_bytes
        return self.engine.read(raw, self.files[index], 0)

    def _submit_write(self, index: int, buffer: _DeviceBuffer, checkpoint: StepCheckpoint | None,
                      fresh: dict[int, StateFile]) -> None:
        """Start the write-back of bucket ``index`` from ``buffer``: to its cache, to a new
        file (the checkpoint's, or ``fresh``'s for a shared file), or in place; with a
        mirror file of the checkpoint's too where it writes twice."""
        bucket = self.buckets[index]
        raw = buffer.raw[:bucket.data_bytes]
        target = checkpoint.bucket_file(index) if checkpoint is not None else None
        if index in self.host_cache:
            self._stale.add(index)
            buffer.write = self._host_copy(self.host_cache[index], raw, to_device=False)
            return
        self.bytes_written += bucket.file_bytes
        mirror = None
        if target is not None and checkpoint.links:
            buffer.replacing = _Replacement(index, target, True)
        elif index in fresh:
            buffer.replacing = _Replacement(index, fresh.pop(index), False)
            mirror = target
        else:
            mirror = target
        file = buffer.replacing.file if buffer.replacing is not None else None
        buffer.write = self._write(raw, bucket, file=file, mirror=mirror)

    def _host_copy(self, dst: torch.Tensor, src: torch.Tensor, *, to_device: bool) -> _HostCopy:
        """Copy between a device buffer and the host cache: on the CPU at once; on CUDA on
        the store's copy stream, after what the caller's stream has queued, so it runs
        beside the caller's update of the other buffer."""
        if not (dst.is_cuda or src.is_cuda):
            dst.copy_(src)
            return _HostCopy()
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
        return _HostCopy(done, current if to_device else None)

    def _sync_host_copies(self) -> None:
        if self._copy_stream is not None:
            self._copy_stream.synchronize()

    # -- the files around the stream (Note [host cache]) ------------------------------
    def flush(self) -> None:
        """Make every bucket file hold the live state: drain I/O, then write the cached
        buckets whose files are stale out through the engine (checksummed) and sync
        them. Call it before reading the files around the stream."""
        self.engine.drain()
        self._sync_host_copies()
        stale = sorted(self._stale)
        for index in stale:
            self._store_file(index, self.host_cache[index])
            self._stale.discard(index)

    def _store_file(self, index: int, raw: torch.Tensor) -> None:
        """Write a whole bucket's bytes to its file, synced, its pages dropped; to a new
        inode when the file is shared (Note [new inodes])."""
        fresh = self._new_files([index])
        replacing = _Replacement(index, fresh[index], False) if fresh else None
        file = replacing.file if replacing is not None else self.files[index]
        try:
            self._write(raw, self.buckets[index], file=file).wait()
            file.sync()
        except BaseException:
            if replacing is not None:
                self._drop(replacing)
            raise
        if replacing is not None:
            self._install(replacing)
        self.bytes_written += self.buckets[index].file_bytes

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

    def _decode(self, index: int, buffer: _DeviceBuffer) -> BucketState:
        bucket = self.buckets[index]
        raw = buffer.raw
        if bucket.remainder:
            master = self._scratch_tensor("master")[:bucket.numel]
            params = [(start, self.params(i)) for i, start in zip(bucket.entries, bucket.offsets)]
            reseeded = remainder.decode(master, self._low_view(raw, bucket), self._fixups_view(raw, bucket), params)
            self.reseeded_blocks = reseeded + self.reseeded_blocks
        else:
            master = self._master_view(raw, bucket) if bucket.master is not None else None
        moments = []
        for codec, seg, key in ((self.avg_codec, bucket.exp_avg, "exp_avg"),
                                (self.sq_codec, bucket.exp_avg_sq, "exp_avg_sq")):
            if seg is None:
                moments.append(None)
                continue
            seg_raw = raw[seg.offset:seg.offset + seg.nbytes]
            if codec.identity:
                moments.append(codec.view(seg_raw, bucket.numel))
            else:
                work = self._scratch_tensor(key)[:bucket.numel]
                codec.decode(seg_raw, work)
                moments.append(work)
        shapes = [self.entries[i].shape for i in bucket.entries]
        return BucketState(bucket=bucket, master=master, exp_avg=moments[0], exp_avg_sq=moments[1], _shapes=shapes)

    def _encode(self, state: BucketState, buffer: _DeviceBuffer) -> None:
        bucket = state.bucket
        if bucket.remainder:
            self._encode_remainder(bucket, state.master, buffer.raw)
        for codec, seg, work in ((self.avg_codec, bucket.exp_avg, state.exp_avg),
                                 (self.sq_codec, bucket.exp_avg_sq, state.exp_avg_sq)):
            if seg is not None and not codec.identity:
                codec.encode(work, buffer.raw[seg.offset:seg.offset + seg.nbytes])

    def _encode_remainder(self, bucket: Bucket, master: torch.Tensor, raw: torch.Tensor) -> None:
        remainder.encode(master, self._low_view(raw, bucket), self._fixups_view(raw, bucket),
                         label=f"{self.path(bucket.index)}: bucket {bucket.index} of the optimizer state")

    # -- buffers --------------------------------------------------------------------
    @staticmethod
    def _low_view(raw: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return raw[bucket.master.offset:bucket.master.offset + bucket.master.nbytes].view(torch.int16)

    @staticmethod
    def _fixups_view(raw: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return raw[bucket.fixups.offset:bucket.fixups.offset + bucket.fixups.nbytes]

    @staticmethod
    def _master_view(raw: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        return raw[bucket.master.offset:bucket.master.offset + bucket.master.nbytes].view(torch.float32)

    def _buffer(self, i: int) -> _DeviceBuffer:
        while len(self._buffers) <= i:
            self._buffers.append(_DeviceBuffer(self.max_bucket_bytes, self.device))
        return self._buffers[i]

    def _scratch_tensor(self, key: str) -> torch.Tensor:
        if key not in self._scratch:
            numel = max(b.numel for b in self.buckets)
            self._scratch[key] = torch.empty(numel, dtype=torch.float32, device=self.device)
        return self._scratch[key]

    def device_bytes(self) -> int:
        """Device memory the store holds now (bucket buffers and scratch)."""
        return sum(s.raw.numel() for s in self._buffers) + sum(t.numel() * 4 for t in self._scratch.values())

    def release_device_buffers(self) -> None:
        """Drain I/O and give the device buffers and scratch back (before the actor sleeps,
        say): between steps they hold nothing the files lack, and ``stream`` and
        ``initialize`` make them again when next needed."""
        try:
            self.engine.drain()
        finally:
            self._sync_host_copies()
            self._buffers.clear()
            self._scratch.clear()

    def close(self) -> None:
        """Flush the host cache, drain I/O, close the files (they stay on disk, holding
        the state) and free the device buffers and the host cache."""
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
                    _unpin(host)
            self.host_cache.clear()
            self._stale.clear()


__all__ = ["Bucket", "BucketState", "BucketStore", "DEFAULT_BUCKET_NUMEL", "Entry", "FILE_PATTERN", "Segment",
           "build_buckets"]
