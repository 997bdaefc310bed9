"""Checkpoints of the streamed state: a manifest, the bucket files, and the small resident state.

A checkpoint is a directory::

    manifest.json      format version, dtypes, bucket layout, topology, steps, checksums
    bucket-NNNNN.bin   the live bucket files' bytes (their inodes, clones or copies)
    resident.pt        step counters and the resident (tiny fp32) params' moments

``save_checkpoint`` runs between steps (the step cannot change a bucket while it is
being saved) and is atomic through ``greenroom.io.publish``, the protocol the trainer's
``--save`` shares: everything goes into ``<path>.new``, which is fsynced and then
swapped with ``<path>`` in one rename, so an interrupted save leaves the previous
checkpoint as it was, and the next save or load settles what a killed one left. Each
bucket file reaches ``<path>.new`` the cheapest way the filesystems allow, said in the
returned ``kind``:

- ``link``: a hard link to the live file (Note [a save by links]): no byte moves;
- ``clone``: where links are refused but the filesystem shares extents (XFS with
  reflink, btrfs; a link into an XFS project tree of another project gives EXDEV), an
  extent clone (``reflink``): no data moves;
- ``copy``: elsewhere (another filesystem, GREENROOM_VERIFY=0, too little room for the
  next step's new inodes) the bytes move (``filecopy.copy_file``), each read once and
  checked against the live file's checksums as it is copied.

A linked or cloned file is recorded in the manifest by its checksum table's CRC-32
(``table_crc32``, the table read back, a few KiB), as a checkpoint written by a step's
own pass (``instep``) is, which is ended here too (``finish_checkpoint``).

Note [a save by links]: between steps every live bucket file is complete and
consistent: the step's writes are drained, and the host cache's buckets are written
out first (``flush``; a cached bucket's file is stale until then). So the staged
checkpoint can take each live file's inode under a second name, table and frame
records included (they live at the file's end). From then on the live file is shared,
and the store never writes a shared inode in place (``optim.store.files`` Note [new
inodes]): the next step writes each bucket to a new file renamed over the live name,
and the checkpoint keeps the bytes it saved. Those new files take the state's size
again, so links are used only where the filesystem has that room free (else the save
copies, and running out of space is refused at the save, not at the next step). What
a link cannot do is check the bytes it shares: a byte flipped in a live file since the
step wrote it is published with it. So a checkpoint with linked or cloned files is not
trusted until ``verify_linked`` has read them back against their checksum tables; a
save by links returns ``"verify": True`` to say so, and ``greenroom train`` keeps the
previous checkpoint until it has (``train.rotation`` Note [a checkpoint is verified
before it counts]). A caller of ``save_checkpoint`` that replaces its only checkpoint
in place passes ``verify=True`` to have the save read them before it publishes (Note [a
save verifies what it copies] is the copy's). A user who writes into a checkpoint's file
in place while it is linked writes the live file too.

A live bucket file that is missing or unreadable at the save (deleted, its permissions
changed) is one ``CheckpointError`` naming it; nothing is published.

``load_checkpoint`` checks everything before it reads a byte of state, in this order:
the manifest exists (else the checkpoint predates streaming: refused unless
``no_load_optim``), the dtypes, the topology, the layout (and the optimizer's moments
per param), the file sizes and every checksum (a ``table_crc32`` file: the table, then
every byte against it). Only then do the live files take the checkpoint's bytes.

Note [a load never writes a checkpoint's inode]: where the state dir takes hard links
to the checkpoint's files (one filesystem), each live name becomes a link to the
checkpoint's file: no byte moves, and the next write of that bucket goes to a new inode
(``optim.store.files`` Note [new inodes]), so the resumed run never writes the checkpoint.
Elsewhere the bytes are cloned or copied: in place into a live file whose inode has no
other name, else into a new file renamed over the live name. A checkpoint saved without
checksums is copied (its tables are written after the copy, into the live file only).

The optimizer is read and restored only through ``StreamedState``, which ``StreamingAdam``
and greenroom.megatron's ``StreamingDistributedOptimizer`` implement.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import TYPE_CHECKING, Protocol

import torch

from greenroom.dirs.rankdir import write_json_atomic
from greenroom.errors import CheckpointError, IntegrityError, StorageError
from greenroom.faults import kill_point
from greenroom.io import fs, publish
from greenroom.io.engine import ALIGNMENT, EXTENT, StateFile, aligned_host, page_sums
from greenroom.log import get_logger
from greenroom.optim.checkpoint import reflink
from greenroom.optim.checkpoint.filecopy import PIECE, FileSums, copy_file, file_crc32, read_pieces
from greenroom.optim.store.hardlink import NEW_SUFFIX, link_new, links_work
from greenroom.tensors import local_tensor

if TYPE_CHECKING:
    from greenroom.optim.store.bucket_store import BucketStore

MANIFEST = "manifest.json"
RESIDENT = "resident.pt"
FORMAT = "greenroom-streamed-adam"
VERSION = 1
log = get_logger(__name__)


class StreamedState(Protocol):
    """What a checkpoint reads and restores of a streaming optimizer, and all it reads.

    Params are named by keys the optimizer chooses, stable across runs of the same model
    and grouping (``"0.3"`` for StreamingAdam, ``"main.0.3"``/``"fp32.0.1"`` for megatron).
    """

    @property
    def store(self) -> BucketStore:
        """The bucket files: the streamed params' masters and moments."""

    def keyed_params(self) -> dict[str, torch.Tensor]:
        """The params whose state streams or stays resident, by key (their DTensor shard
        identity goes into the manifest's topology)."""

    def resident_params(self) -> dict[str, torch.Tensor]:
        """Every param ``resident_state`` may name, by key (those with no bytes in the
        files too: an empty FSDP2 shard keeps a step counter)."""

    def resident_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The state outside the bucket files, by key: each param's ``step`` counter and the
        resident params' ``exp_avg`` and ``exp_avg_sq`` (what ``resident.pt`` holds)."""

    def load_resident_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Replace the state outside the bucket files with ``state`` (CPU tensors, the
        shape ``resident_state`` returns)."""

    def hyperparameters(self) -> list[dict]:
        """Each param group's hyperparameters, without its params, as JSON can hold them
        (tuples allowed)."""

    def load_hyperparameters(self, groups: list[dict]) -> None:
        """Set each param group's hyperparameters from ``groups`` (in group order)."""

    def initialize_state(self) -> None:
        """A fresh state: masters from the current params, zero moments, no steps taken."""


# -- what the checkpoint records ------------------------------------------------------
def topology(opt: StreamedState) -> dict:
    """World size, rank, and the shard identity of every DTensor (FSDP2) param."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    shards = {}
    for key, p in opt.keyed_params().items():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            shards[key] = {
                "global_shape": list(p.shape),
                "placements": [str(pl) for pl in p.placements],
                "mesh": mesh.mesh.flatten().tolist(),
                "coordinate": list(mesh.get_coordinate() or ()),
            }
    return {
        "world_size": dist.get_world_size() if initialized else 1,
        "rank": dist.get_rank() if initialized else 0,
        "shards": shards,
    }


def _hyperparameters(opt: StreamedState) -> list[dict]:
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in opt.hyperparameters()]


def _resident_state(opt: StreamedState) -> dict:
    steps, moments = {}, {}
    for key, state in opt.resident_state().items():
        steps[key] = state["step"].detach().cpu()
        if "exp_avg" in state:
            moments[key] = {
                "exp_avg": state["exp_avg"].detach().cpu(),
                "exp_avg_sq": state["exp_avg_sq"].detach().cpu(),
            }
    return {"steps": steps, "moments": moments}


# -- save ------------------------------------------------------------------------------
def save_checkpoint(opt: StreamedState, path: str, *, verify: bool = False) -> dict:
    """Write ``opt``'s whole state to the directory ``path``, replacing it atomically
    (``greenroom.io.publish``: the previous checkpoint stays until this one is complete).
    Returns how: ``{"kind": "link", "clone" or "copy", "bytes_read": ..., "bytes_written":
    ..., "verify": ...}`` (the state's bytes the save moved; a link or a clone moves only
    the checksum tables, read; ``kind`` names the costliest way any file took; ``verify``:
    linked or cloned files are not verified yet, ``verify_linked`` reads them). With
    ``verify``, the save reads them back itself before it publishes (``bytes_read``
    counts it), so the checkpoint it replaces goes only for one known good. One save at a time
    (``publish`` Note [one writer per checkpoint dir]); a symlink is resolved once, so a
    killed save beside its target is settled like any other."""
    path = os.path.realpath(path)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with publish.locked(path):
        return _save_checkpoint(opt, path, verify)


def _save_checkpoint(opt: StreamedState, path: str, verify: bool) -> dict:
    tmp, said = publish.stage(path)
    if said:
        log.warning(f"{path}: {said}")
    try:
        store = opt.store
        store.flush()  # the cached buckets' files are stale until written out (Note [host cache])
        for bucket in store.buckets:
            _check_live(store.path(bucket.index))
        files, ways = {}, set()
        moved = {"bytes_read": 0, "bytes_written": 0}
        link = _links_usable(store, tmp)
        clone = reflink.usable(store.directory, tmp, store.state_bytes)
        for bucket in store.buckets:
            name = os.path.basename(store.path(bucket.index))
            src, dst = store.path(bucket.index), os.path.join(tmp, name)
            try:
                link = link and link_new(src, dst)
                if not link:
                    clone = clone and reflink.clone(src, dst)
                if link or clone:
                    crc = table_crc32(store, bucket.index, dst)
            except OSError as e:
                raise _unreadable(src, e) from None
            if link or clone:
                ways.add("link" if link else "clone")
                files[name] = {"bytes": bucket.file_bytes, "table_crc32": crc}
                moved["bytes_read"] += bucket.file_bytes - bucket.data_bytes  # the table only
                if verify:
                    _verify_against_table(store, dst, name, crc)
                    moved["bytes_read"] += bucket.data_bytes
            else:
                ways.add("copy")
                # Every byte copied is checked against the live file's checksums (Note [a
                # save verifies what it copies]); without them (GREENROOM_VERIFY=0) the
                # manifest says so.
                live = FileSums(store.files[bucket.index], expect=True) if store.engine.verify else None
                files[name] = {
                    "bytes": bucket.file_bytes,
                    "crc32": copy_file(src, dst, bucket.file_bytes, check=live.add if live else None),
                }
                if live is not None:
                    live.verify()
                moved["bytes_read"] += bucket.file_bytes
                moved["bytes_written"] += bucket.file_bytes
            kill_point("save-bucket")
        finish_checkpoint(opt, path, tmp, files)
        return {
            "kind": next((k for k in ("copy", "clone", "link") if k in ways), "link"),
            **moved,
            "verify": not verify and bool(ways & {"link", "clone"}),
        }
    except BaseException:
        if os.path.isdir(tmp):
            publish.discard(tmp)
        raise


def _check_live(path: str) -> None:
    """A live bucket file the save is about to take must be there and readable."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
    except OSError as e:
        raise _unreadable(path, e) from None


def _unreadable(path: str, e: OSError) -> CheckpointError:
    return CheckpointError(
        f"{path}: cannot save this live bucket file ({e.strerror or e}): it was deleted or made "
        "unreadable since the step wrote it; nothing was published, the previous checkpoint stays"
    )


def verify_linked(opt: StreamedState, path: str) -> int:
    """Read back every bucket file of the published checkpoint ``path`` that its save
    linked or cloned (recorded by its table's CRC-32, bytes the save did not read) and
    check it against its table; one ``CheckpointError`` naming the first bad file.
    Returns the bytes read. (``train.rotation`` Note [a checkpoint is verified before it
    counts].)"""
    manifest = read_manifest(path)
    read = 0
    for name, meta in manifest["files"].items():
        if "table_crc32" in meta:
            _verify_against_table(opt.store, os.path.join(path, name), name, meta["table_crc32"])
            read += meta["bytes"]
    return read


def _links_usable(store: BucketStore, tmp: str) -> bool:
    """Whether to save by hard links (Note [a save by links]): the files carry verified
    checksum tables (the manifest records the table's CRC-32), the staged dir takes links
    to them (one filesystem, no policy against it), and the filesystem has room for the
    new inodes the next step will write those buckets to."""
    if not (store.engine.verify and store.buckets):
        return False
    return fs.free_bytes(tmp) >= store.state_bytes and links_work(store.path(0), tmp)


def finish_checkpoint(opt: StreamedState, path: str, tmp: str, files: dict) -> None:
    """Write ``resident.pt`` and the manifest (``files``: the bucket files' entries) into
    the staged ``tmp`` and publish it at ``path``: the end of every save, copied, cloned
    or written in the step (``optim.checkpoint.instep``)."""
    store = opt.store
    resident = _resident_state(opt)
    publish.torch_save(resident, os.path.join(tmp, RESIDENT))
    size = os.path.getsize(os.path.join(tmp, RESIDENT))
    files = {**files, RESIDENT: {"bytes": size, "crc32": file_crc32(os.path.join(tmp, RESIDENT), size)}}
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "master_dtype": "fp32",
        "moment_dtype": store.moment_dtype,
        "layout": store.layout(),
        "topology": topology(opt),
        "param_groups": _hyperparameters(opt),
        "checksums": store.engine.verify,
        "steps": {k: float(v) for k, v in resident["steps"].items()},
        "files": files,
    }
    write_json_atomic(os.path.join(tmp, MANIFEST), manifest)
    publish.publish(path)


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


# -- load ------------------------------------------------------------------------------
def load_checkpoint(opt: StreamedState, path: str, *, no_load_optim: bool = False) -> None:
    """Restore ``opt`` from ``path`` after verifying it matches; see the module docstring."""
    if no_load_optim:
        log.warning(
            f"no_load_optim: not loading the optimizer state from {path}; starting a fresh "
            "optimizer state (masters from the current params, zero moments, step 0)"
        )
        opt.initialize_state()
        return
    path = os.path.realpath(path)
    with publish.locked(path, reading=True):
        said = publish.recover(path)
        if said:
            log.warning(f"{path}: {said}")
        _load_checkpoint(opt, path)


def _load_checkpoint(opt: StreamedState, path: str) -> None:
    manifest = read_manifest(path)
    verify(opt, path, manifest)
    resident = _verified_resident(opt, path)
    # From the first bucket replaced on, a failure leaves a state that is neither the
    # run's nor the checkpoint's (optim.poison Note [a failed step poisons]).
    with opt._poisoned_if_it_fails("load_checkpoint()", "partly loaded (some buckets from the checkpoint, some not)"):
        _replace_state(opt, path, manifest, resident)


def _verified_resident(opt: StreamedState, path: str) -> dict:
    """``resident.pt`` (its CRC-32 checked by ``verify``), refused in one line unless every
    param it names is one of ``opt``'s and every moment has its param's shape and dtype."""
    file_path = os.path.join(path, RESIDENT)
    try:
        resident = torch.load(file_path, weights_only=True)
        steps, moments = resident["steps"], resident["moments"]
    except Exception as e:  # a file that passed its CRC but is not what a save writes
        raise CheckpointError(
            f"{file_path}: not a resident state greenroom wrote ({type(e).__name__}); the checkpoint is damaged"
        ) from None
    params = opt.resident_params()
    for key in sorted(set(steps) | set(moments)):
        if key not in params:
            raise CheckpointError(
                f"{file_path}: holds state for param {key}, which this optimizer does not "
                "have: resume with the model and param groups it was saved with (or pass "
                "--no-load-optim)"
            )
    for key, saved in sorted(moments.items()):
        ours = local_tensor(params[key])
        for name in ("exp_avg", "exp_avg_sq"):
            t = saved.get(name)
            if not isinstance(t, torch.Tensor) or t.shape != ours.shape or t.dtype != ours.dtype:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else "nothing"
                raise CheckpointError(
                    f"{file_path}: param {key}'s {name} is {got}, the param here is "
                    f"{ours.dtype} {tuple(ours.shape)}: resume with the model it was saved "
                    "with (or pass --no-load-optim)"
                )
    return resident


def _replace_state(opt: StreamedState, path: str, manifest: dict, resident: dict) -> None:
    store = opt.store
    store.discard_kept()  # every bucket is replaced: the kept one's bytes must not go over the loaded file
    unsummed = manifest.get("checksums", True) is False and store.engine.verify
    if unsummed:
        log.warning(
            f"{path}: saved with GREENROOM_VERIFY=0, so its bucket files carry no checksums; their bytes "
            "passed the checkpoint's CRC-32, and this run checksums them from here on"
        )
    # Note [a load never writes a checkpoint's inode]
    link = not unsummed and bool(store.buckets) and links_work(os.path.join(path, _name(store, 0)), store.directory)
    clone = not link and reflink.usable(path, store.directory, store.state_bytes)
    for bucket in store.buckets:
        name = _name(store, bucket.index)
        if link:
            store.link_file(bucket.index, os.path.join(path, name))
        else:
            clone = _load_bytes(store, bucket.index, os.path.join(path, name), clone)
        if unsummed:
            sums = FileSums(store.files[bucket.index], expect=False)
            read_pieces(store.path(bucket.index), bucket.data_bytes, sums.add)
            sums.record()
    store.refill_host_cache()
    opt.load_resident_state(
        {key: {"step": step, **resident["moments"].get(key, {})} for key, step in resident["steps"].items()}
    )
    opt.load_hyperparameters(
        [{k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items()} for saved in manifest["param_groups"]]
    )


def _name(store: BucketStore, index: int) -> str:
    return os.path.basename(store.path(index))


def _load_bytes(store: BucketStore, index: int, source: str, clone: bool) -> bool:
    """Put the checkpoint file ``source`` into bucket ``index``'s live file by a clone
    (while ``clone``) or a copy: in place while the live inode has no other name, else
    into a new file renamed over it. Returns whether to go on cloning."""
    bucket = store.buckets[index]
    live = store.path(index)
    shared = store.shared(index)
    target = live + NEW_SUFFIX if shared else live
    if shared:
        store.open_copy(index, target).close()  # preallocated: no space is refused before the copy
    try:
        if clone and reflink.clone(source, target):
            cloned = True
        else:
            cloned = False
            copy_file(source, target, bucket.file_bytes)
    except BaseException:
        if shared and os.path.lexists(target):
            os.unlink(target)
        raise
    if shared:
        store.replace_file(index, target)
    return cloned


def read_manifest(path: str) -> dict:
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(
            f"{path}: no streamed optimizer state ({MANIFEST} missing: written before streaming was enabled, "
            "or not a StreamingAdam checkpoint); pass no_load_optim=True (--no-load-optim) to accept a fresh "
            "optimizer state"
        )
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
    except ValueError as e:
        raise CheckpointError(f"{manifest_path}: not valid JSON ({e}); the checkpoint is damaged") from None
    except OSError as e:
        raise CheckpointError(f"{manifest_path}: cannot read it ({e.strerror})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{manifest_path}: not a JSON object; the checkpoint is damaged")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{manifest_path}: format {manifest.get('format')!r} version "
            f"{manifest.get('version')!r}, this greenroom reads {FORMAT!r} version {VERSION}"
        )
    for key, kind in _MANIFEST_FIELDS.items():
        if not isinstance(manifest.get(key), kind):
            raise CheckpointError(
                f"{manifest_path}: field {key!r} is missing or not {kind.__name__}; the checkpoint is damaged"
            )
    for name, meta in manifest["files"].items():
        if (
            not isinstance(meta, dict)
            or not isinstance(meta.get("bytes"), int)
            or not isinstance(meta.get("crc32", meta.get("table_crc32")), str)
            or os.sep in name
            or name in (".", "..")
        ):
            raise CheckpointError(
                f"{manifest_path}: the entry for {name!r} in 'files' is malformed; the checkpoint is damaged"
            )
    return manifest


_MANIFEST_FIELDS = {
    "master_dtype": str,
    "moment_dtype": str,
    "layout": dict,
    "topology": dict,
    "param_groups": list,
    "steps": dict,
    "files": dict,
}


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
    missing = [name for name in (_name(store, b.index) for b in store.buckets) if name not in listed]
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
            _verify_against_table(store, file_path, name, meta["table_crc32"])
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


def _verify_against_table(store: BucketStore, file_path: str, name: str, recorded: str) -> None:
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
