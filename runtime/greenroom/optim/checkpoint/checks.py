"""The checks of a checkpoint: against the optimizer that loads it, and each bucket file
against its own checksum table.

``verify`` checks everything before a load reads a byte of state, in this order: the
dtypes, the topology, the layout (and the optimizer's moments per param), the file sizes
and every checksum (a ``table_crc32`` file: the table, then every byte against it). The
first difference is one ``CheckpointError`` naming it.

A bucket file linked or cloned by a save, or written by the step's own pass, is recorded
in the manifest by its checksum table's CRC-32 (``table_crc32``, the table read back, a
few KiB); ``verify_bucket_file`` checks that CRC and then every byte against the table
(``verify_against_table``), which a verified save and ``save_load.verify_linked`` do too.
"""

from __future__ import annotations

import os
import zlib
from typing import TYPE_CHECKING

import torch

from greenroom.errors import CheckpointError, IntegrityError, StorageError
from greenroom.io.engine import ALIGNMENT, EXTENT, StateFile, aligned_host, page_sums
from greenroom.optim.checkpoint.filecopy import PIECE, file_crc32
from greenroom.optim.checkpoint.manifest import MANIFEST, StreamedState, bucket_file_name, topology

if TYPE_CHECKING:
    from greenroom.optim.store.bucket_store import BucketStore


def verify(opt: StreamedState, path: str, manifest: dict) -> None:
    """Raise ``CheckpointError`` naming the first thing in which ``path`` differs from ``opt``."""
    store = opt.store
    for key, ours in (("master_dtype", "fp32"), ("moment_dtype", store.moment_dtype)):
        if manifest[key] != ours:
            raise CheckpointError(
                f"{path}: written with {key.replace('_', ' ')} {manifest[key]}, this run uses {ours}; bytes "
                f"written as {manifest[key]} cannot be read as {ours}: resume with "
                f"--stream-optimizer-state-moment-dtype {manifest[key]} (or pass --no-load-optim)"
            )
    try:
        _verify_topology(path, manifest["topology"], topology(opt))
        _verify_layout(path, manifest["layout"], store.layout())
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"{os.path.join(path, MANIFEST)}: malformed topology or layout ({e!r}); the checkpoint is damaged"
        ) from None
    listed = manifest["files"]
    missing = [name for name in (bucket_file_name(store, b.index) for b in store.buckets) if name not in listed]
    if missing:
        raise CheckpointError(
            f"{path}: the manifest lists no {missing[0]} of its layout's buckets; the checkpoint is "
            "incomplete: restore it or load an older checkpoint"
        )
    for name, meta in manifest["files"].items():
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path):
            raise CheckpointError(f"{file_path} is missing; the checkpoint is incomplete")
        actual = os.path.getsize(file_path)
        if actual != meta["bytes"]:
            raise CheckpointError(f"{file_path}: {actual} bytes, the manifest says {meta['bytes']} (truncated?)")
        if "table_crc32" in meta:
            verify_bucket_file(store, file_path, name, meta["table_crc32"])
            continue
        crc = file_crc32(file_path, meta["bytes"])
        if crc != meta["crc32"]:
            raise CheckpointError(
                f"{file_path}: checksum {crc} does not match the manifest's {meta['crc32']}; "
                "the file is corrupt: restore it or load an older checkpoint"
            )


def _verify_topology(path: str, saved: dict, ours: dict) -> None:
    for key in ("world_size", "rank"):
        if saved[key] != ours[key]:
            raise CheckpointError(
                f"{path}: saved with {key.replace('_', ' ')} {saved[key]}, this run has "
                f"{ours[key]}; resume is same-topology only (the files hold one rank's shard)"
            )
    for name in sorted(set(saved["shards"]) | set(ours["shards"])):
        a, b = saved["shards"].get(name), ours["shards"].get(name)
        if a != b:
            raise CheckpointError(
                f"{path}: param {name} was sharded as {a}, this run shards it as {b}; resume is same-topology only"
            )


def _verify_layout(path: str, saved: dict, ours: dict) -> None:
    saved_masters, our_masters = saved.get("master_layout", "fp32"), ours["master_layout"]
    if saved_masters != our_masters:
        raise CheckpointError(
            f"{path}: the state files store the fp32 masters as {saved_masters}, this run as "
            f"{our_masters}: resume with master_layout={saved_masters!r} (or pass --no-load-optim)"
        )
    saved_moments = saved.get("moments", 2)
    if saved_moments != ours["moments"]:
        kinds = {1: "a momentum buffer (StreamingMuon)", 2: "two Adam moments (StreamingAdam)"}
        raise CheckpointError(
            f"{path}: the state was saved with {kinds.get(saved_moments, saved_moments)} per "
            f"param, this optimizer keeps {kinds[ours['moments']]}; load it with that optimizer"
        )
    saved_codec, our_codec = saved.get("compression", "none"), ours["compression"]
    if saved_codec != our_codec:
        raise CheckpointError(
            f"{path}: the state files were written with --offload-train-disk-compression "
            f"{saved_codec}, this run stores {our_codec}: resume with "
            f"--offload-train-disk-compression {saved_codec}"
        )
    if saved["bucket_numel"] != ours["bucket_numel"]:
        raise CheckpointError(
            f"{path}: layout differs: saved with bucket_numel {saved['bucket_numel']}, this run "
            f"has {ours['bucket_numel']}; build the optimizer with "
            f"bucket_numel={saved['bucket_numel']} (greenroom train does so itself)"
        )
    # Checkpoints written before masters could be remainders record no such field: whole masters.
    saved = {
        **saved,
        "entries": [{"remainder": False, **e} for e in saved["entries"]],
        "buckets": [{**b, "segments": {"fixups": None, **b["segments"]}} for b in saved["buckets"]],
    }
    if len(saved["entries"]) != len(ours["entries"]):
        raise CheckpointError(
            f"{path}: layout differs: {len(saved['entries'])} streamed params saved, this run "
            f"has {len(ours['entries'])}"
        )
    for a, b in zip(saved["entries"], ours["entries"]):
        if a != b:
            raise CheckpointError(f"{path}: layout differs at param {a['name']}: saved {a}, this run has {b}")
    if saved["buckets"] != ours["buckets"]:
        raise CheckpointError(f"{path}: layout differs: the bucket files do not match this run's buckets")


def verify_bucket_file(store: BucketStore, file_path: str, name: str, recorded: str) -> None:
    """Check a bucket file written in the step or cloned: its checksum table against the
    manifest's CRC-32 of it, then every byte against the table."""
    index = next((b.index for b in store.buckets if os.path.basename(store.path(b.index)) == name), None)
    if index is None:
        raise CheckpointError(f"{file_path}: not a bucket file of this run's layout; the checkpoint is damaged")
    try:
        with store.open_existing(index, file_path) as f:
            crc = _table_crc32_on_disk(f)
            if crc != recorded:
                raise CheckpointError(
                    f"{file_path}: checksum table CRC-32 {crc} does not match the manifest's "
                    f"{recorded}; the file is corrupt: restore it or load an older checkpoint"
                )
            verify_against_table(f)
    except (StorageError, IntegrityError) as e:
        raise CheckpointError(f"{e}") from None


def table_crc32(store: BucketStore, index: int, path: str) -> str:
    """CRC-32 of the checksum table at the end of bucket ``index``'s file at ``path``
    (a few KiB read): what the manifest records of a file that was cloned, not read."""
    with store.open_existing(index, path) as f:
        return _table_crc32_on_disk(f)


def _table_crc32_on_disk(f: StateFile) -> str:
    table = aligned_host(f.table_bytes(f.size, compressed=f.compression is not None))
    f.read(memoryview(table.numpy()), f.table_offset)
    return f"{zlib.crc32(memoryview(table.numpy())):08x}"


def verify_against_table(f: StateFile, piece_bytes: int = PIECE) -> None:
    """Read ``f``'s whole data region, piece by piece, and check it against the file's own
    checksum table (``integrity`` Note [integrity]; for a compressed file, each frame's
    stored bytes where its record puts them, Note [packed frames]): a file copied or
    cloned around the I/O engine, before it is trusted. ``IntegrityError`` names the
    first extent that differs."""
    sums, stored = f.recorded(0, f.data_bytes)
    if f.compression is not None and stored is None:
        raise IntegrityError(f"{f.path}: {f.label} has no record of its stored frames; it cannot be verified")
    buf = aligned_host(min(piece_bytes, f.data_bytes))
    pages = []
    for offset in range(0, f.data_bytes, piece_bytes):
        view = buf[: min(piece_bytes, f.data_bytes - offset)]
        f.read(memoryview(view.numpy()), offset)
        pages.append(page_sums(view, offset))
    pages = torch.cat(pages)
    extents = sums.numel()
    if stored is None:  # extent k: its pages
        owner = torch.arange(pages.numel(), dtype=torch.int64) * ALIGNMENT // EXTENT
    else:  # extent k: the pages of its frame's stored bytes, ``shift`` before its own place
        counts = (stored[:, 0].to(torch.int64) + ALIGNMENT - 1) // ALIGNMENT
        first = (torch.arange(extents, dtype=torch.int64) * EXTENT - stored[:, 1].to(torch.int64)) // ALIGNMENT
        owner = torch.repeat_interleave(torch.arange(extents, dtype=torch.int64), counts)
        within = torch.arange(owner.numel(), dtype=torch.int64) - torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts
        )
        index = first[owner] + within
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= pages.numel()):
            raise IntegrityError(
                f"{f.path}: the frame records of {f.label} point outside its data; the table is damaged"
            )
        pages = pages[index]
    got = torch.zeros(extents, dtype=torch.int64).index_add_(0, owner, pages)
    bad = (got != sums).nonzero()
    if bad.numel():
        k = int(bad[0])
        raise IntegrityError(
            f"{f.path}: checksum mismatch in extent {k} (bytes [{k * EXTENT}, "
            f"{min((k + 1) * EXTENT, f.data_bytes)}) of {f.label}): the file is corrupt: "
            "restore it or load an older checkpoint"
        )
