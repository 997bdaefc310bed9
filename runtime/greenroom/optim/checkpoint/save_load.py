"""Checkpoints of the streamed state: the save between steps and the verified load.

What a checkpoint holds (a manifest, the bucket files, the small resident state) is
``manifest``; what a load checks before it reads a byte of state is ``checks``.

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
(``checks.table_crc32``, the table read back, a few KiB), as a checkpoint written by a
step's own pass (``instep``) is; both end in ``manifest.finish_checkpoint``.

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

``load_checkpoint`` checks everything before it reads a byte of state
(``checks.verify``; a missing manifest means the checkpoint predates streaming: refused
unless ``no_load_optim``). Only then do the live files take the checkpoint's bytes.

Note [a load never writes a checkpoint's inode]: where the state dir takes hard links
to the checkpoint's files (one filesystem), each live name becomes a link to the
checkpoint's file: no byte moves, and the next write of that bucket goes to a new inode
(``optim.store.files`` Note [new inodes]), so the resumed run never writes the checkpoint.
Elsewhere the bytes are cloned or copied: in place into a live file whose inode has no
other name, else into a new file renamed over the live name. A checkpoint saved without
checksums is copied (its tables are written after the copy, into the live file only).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from greenroom.errors import CheckpointError
from greenroom.faults import kill_point
from greenroom.io import fs, publish
from greenroom.log import get_logger
from greenroom.optim.checkpoint import reflink
from greenroom.optim.checkpoint.checks import table_crc32, verify, verify_bucket_file
from greenroom.optim.checkpoint.filecopy import FileSums, copy_file, read_pieces
from greenroom.optim.checkpoint.manifest import (
    RESIDENT,
    StreamedState,
    bucket_file_name,
    finish_checkpoint,
    read_manifest,
)
from greenroom.optim.store.hardlink import NEW_SUFFIX, link_new, links_work
from greenroom.tensors import local_tensor

if TYPE_CHECKING:
    from greenroom.optim.store.bucket_store import BucketStore

log = get_logger(__name__)


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
                    verify_bucket_file(store, dst, name, crc)
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
            verify_bucket_file(opt.store, os.path.join(path, name), name, meta["table_crc32"])
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
    link = (
        not unsummed
        and bool(store.buckets)
        and links_work(os.path.join(path, bucket_file_name(store, 0)), store.directory)
    )
    clone = not link and reflink.usable(path, store.directory, store.state_bytes)
    for bucket in store.buckets:
        name = bucket_file_name(store, bucket.index)
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
