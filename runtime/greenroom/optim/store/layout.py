"""The layout of the streamed state: which tensors share a bucket file, and where in it.

- ``Entry``: one tensor's worth of state (name, shape, param group, whether an fp32
  master is stored, whether as a remainder).
- ``Bucket``: consecutive entries of one kind in one file of 4 KiB-aligned ``Segment`` ranges,
  ``[master | exp_avg | exp_avg_sq]`` (``optim.store`` describes the file).
- ``build_buckets``: the grouping rule; ``BucketState``: one bucket on the device, as
  ``BucketStore.stream`` yields it; ``describe``: the layout as JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from greenroom.errors import ConfigError
from greenroom.io.engine import StateFile, align_up
from greenroom.optim import remainder
from greenroom.optim.moments import moment_codecs

DEFAULT_BUCKET_NUMEL = 100_000_000
DEVICE_BUFFERS = 3
"""Bucket buffers a step keeps on the device (``BucketStore.stream``): one updating, one
reading ahead, and one whose write-back is still draining, so the read of bucket k+1
waits for the write-back of bucket k-2 only, never for that of k-1. On the H200 three
buffers of 1e8-element buckets ran the bf16-moment step of 1e9 params in 0.52 of its
disk bound where two of 2e8 took 0.61, in less HBM (2.33 GB against 2.65;
docs/benchmarks.md, 'Design measurements')."""
FILE_PATTERN = "bucket-{:05d}.bin"


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
            out.append(flat[start : start + n].view(shape))
        return out


def build_buckets(
    entries: Sequence[Entry], bucket_numel: int, moment_dtype: str, *, compressed: bool = False, moments: int = 2
) -> list[Bucket]:
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
        buckets.append(
            Bucket(
                index=index,
                entries=tuple(members),
                numel=numel,
                master=master,
                exp_avg=exp_avg,
                exp_avg_sq=exp_avg_sq,
                data_bytes=cursor,
                file_bytes=StateFile.file_bytes(cursor, checksums="file", compressed=compressed),
                offsets=tuple(offsets),
                fixups=fixups,
            )
        )
    return buckets


__all__ = [
    "Bucket",
    "BucketState",
    "DEFAULT_BUCKET_NUMEL",
    "DEVICE_BUFFERS",
    "Entry",
    "FILE_PATTERN",
    "Segment",
    "build_buckets",
]


def master_layout(entries: Sequence[Entry]) -> str:
    """``remainder`` when any master is stored as a remainder (Note [remainder]), else ``fp32``."""
    return "remainder" if any(e.remainder for e in entries) else "fp32"


def describe(
    entries: Sequence[Entry],
    buckets: Sequence[Bucket],
    *,
    bucket_numel: int,
    moment_dtype: str,
    moments: int,
    compression: str,
) -> dict:
    """The layout as JSON (``BucketStore.layout``): what a checkpoint must match to be read back."""
    return {
        "bucket_numel": bucket_numel,
        "moment_dtype": moment_dtype,
        "master_dtype": "fp32",
        "master_layout": master_layout(entries),
        "moments": moments,
        "compression": compression,
        "entries": [
            {"name": e.name, "shape": list(e.shape), "group": e.group, "master": e.master, "remainder": e.remainder}
            for e in entries
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
            for b in buckets
        ],
    }
