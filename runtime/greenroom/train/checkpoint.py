"""``--save`` / ``--load`` for ``greenroom train``: per-rank model and optimizer state.

``--save ROOT`` writes one such dir per save, ``ROOT/iter_<NNNNNNN>``, with a pointer
to the newest verified one and retention (``greenroom.train.rotation``). Layout of a
checkpoint dir ``DIR``::

    generation.json      this save's id and the one it replaced (greenroom.io.publish)
    meta.json            iteration, world size, how the optimizer state was kept
    rank<NNNNN>/
      manifest.json      size and CRC-32 of every file of the rank
      model.pt
      optim.pt           resident AdamW, or
      optim/             StreamingAdam's own checkpoint (its manifest checksums its files)

The whole checkpoint, every rank's model and optimizer state and the meta, becomes
visible in one rename (``greenroom.io.publish``, the protocol the optimizer's checkpoint
uses too): rank 0 stages ``DIR.new``, every rank writes its part there, and rank 0
writes the meta and renames it into place once all are done. A save at the end of an
iteration (``--save``, ``--save-interval``) stages before the iteration's last optimizer
step, which writes the streamed state into ``optim/`` from its own pass
(``greenroom.optim.checkpoint.instep``); the weights, manifests, meta and publish follow
the step, in the background with ``--async-save``. ``load`` first settles what a killed
save left (and says what it did), then checks every file's size and checksum before it
loads a byte; each damaged or missing file, and each malformed manifest or meta, is one
``CheckpointError`` line naming the file. Resume is same-topology only, as for the
streamed state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import zlib

import torch

from greenroom.errors import CheckpointError, one_line
from greenroom.faults import kill_point
from greenroom.io import publish
from greenroom.log import get_logger
from greenroom.optim.checkpoint.filecopy import PIECE
from greenroom.optim.checkpoint.save_load import read_manifest
from greenroom.tensors import local_tensor
from greenroom.train import rotation

META = "meta.json"
MANIFEST = "manifest.json"
FAILED = "failed.txt"  # a rank's part of a save failed: the one line why (``_wait_for_ranks`` reads it)
FORMAT = 2
_META_FIELDS = {"format": int, "iteration": int, "world_size": int, "streaming": bool}
log = get_logger(__name__)


_DTYPE_FLAGS = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def dtype_flag(state: dict[str, torch.Tensor]) -> str:
    """The ``--dtype`` the weights (a model's state dict) are in (``str(dtype)`` for one no flag gives)."""
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.float32)
    return _DTYPE_FLAGS.get(dtype, str(dtype))


def _model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: local_tensor(t.detach()).clone().cpu() for name, t in model.state_dict().items()}


def rank_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank:05d}")


def saved_bucket_numel(directory: str, rank: int) -> int | None:
    """The ``bucket_numel`` this rank's streamed state was saved with, so that a resumed run
    builds the same layout even where it differs from ``DEFAULT_BUCKET_NUMEL`` (a state saved
    with buckets of 2e8 elements); None where it cannot be read, and the load then says what is wrong."""
    try:
        numel = read_manifest(os.path.join(rank_path(directory, rank), "optim"))["layout"].get("bucket_numel")
    except CheckpointError:
        return None
    return numel if isinstance(numel, int) and not isinstance(numel, bool) and numel > 0 else None


def _crc32(path: str) -> tuple[int, str]:
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        while piece := f.read(PIECE):
            crc = zlib.crc32(piece, crc)
            size += len(piece)
    return size, f"{crc:08x}"


# -- save ------------------------------------------------------------------------------
def begin(directory: str, *, rank: int, barrier) -> str:
    """Start a save: rank 0 settles what an earlier save left and stages ``DIR.new``;
    returns this rank's dir in it (created). The optimizer's in-step checkpoint
    (``optim/`` in it) is requested right after this, before the step that writes it."""
    directory = os.path.realpath(directory)
    if rank == 0:
        os.makedirs(os.path.dirname(directory), mode=0o700, exist_ok=True)
        _, said = publish.stage(directory)
        if said:
            log.warning(f"--save {directory}: {said}")
    barrier()
    mine = rank_path(directory + publish.NEW_SUFFIX, rank)
    os.makedirs(mine, mode=0o700)
    return mine


def save(
    directory: str,
    *,
    model,
    optimizer,
    streaming: bool,
    iteration: int,
    rank: int,
    world_size: int,
    barrier,
    verify: bool = False,
) -> None:
    """A whole save between steps: stage, write every part (the streamed state linked,
    cloned or copied, ``save_checkpoint``), publish; under the lock of the root the
    iteration dir ``directory`` is in (``publish`` Note [one writer per checkpoint dir];
    ``greenroom train`` holds it for the whole run). ``verify``: the streamed state's
    linked files are read back before the publish (``save_checkpoint(verify=True)``)."""
    root = os.path.dirname(os.path.realpath(directory))
    with publish.locked(root) if rank == 0 else contextlib.nullcontext():
        try:
            begin(directory, rank=rank, barrier=barrier)
        except BaseException as e:
            _discard(directory, rank, e)
            raise
        finish(
            directory,
            model_state=model_state(model),
            model_config=model_config(model),
            optimizer=optimizer,
            optim_state=None,
            streaming=streaming,
            optim_written=False,
            iteration=iteration,
            rank=rank,
            world_size=world_size,
            barrier=barrier,
            verify=verify,
        )


def model_config(model: torch.nn.Module) -> dict | None:
    """The model's sizes (its ``config`` dataclass, under any DDP wrapper), recorded in the
    meta: two configs can have every tensor the same shape (``--n-heads`` splits the same
    weights another way), so shapes alone cannot tell a checkpoint of another model."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    config = getattr(model, "config", None)
    return dataclasses.asdict(config) if dataclasses.is_dataclass(config) else None


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights as host copies: what ``finish`` writes (taken before the next step
    changes them, so ``finish`` may run beside it)."""
    return _model_state(model)


def optimizer_state(optimizer) -> dict:
    """A resident optimizer's state dict with every tensor copied to the host."""
    from torch.utils._pytree import tree_map  # noqa: PLC2701 (torch's own tree map, no public name)

    return tree_map(
        lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v, optimizer.state_dict()
    )


def finish(
    directory: str,
    *,
    model_state: dict,
    model_config: dict | None,
    optimizer,
    optim_state: dict | None,
    streaming: bool,
    optim_written: bool,
    iteration: int,
    rank: int,
    world_size: int,
    barrier=None,
    verify: bool = False,
) -> None:
    """Write this rank's part of a begun save and publish it (rank 0, once every rank's
    part is there). ``optim_written``: the streamed state is already in ``optim/`` (the
    step wrote it); else it is saved here. ``barrier`` None (``--async-save``, off the
    main thread, where no collective may run): rank 0 waits for every rank's manifest
    file instead, and nothing waits for the publish."""
    directory = os.path.realpath(directory)
    staged = directory + publish.NEW_SUFFIX
    mine = rank_path(staged, rank)
    try:
        publish.torch_save(model_state, os.path.join(mine, "model.pt"))
        kill_point("save-model")
        names = ["model.pt"]
        if streaming:
            if not optim_written:
                optimizer.save_checkpoint(os.path.join(mine, "optim"), verify=verify)
            names.append(os.path.join("optim", "manifest.json"))
        else:
            publish.torch_save(
                optim_state if optim_state is not None else optimizer.state_dict(), os.path.join(mine, "optim.pt")
            )
            names.append("optim.pt")
        kill_point("save-optim")
        files = {}
        for name in names:
            size, crc = _crc32(os.path.join(mine, name))
            files[name] = {"bytes": size, "crc32": crc}
        publish.write_checked_json(os.path.join(mine, MANIFEST), {"files": files})
        kill_point("save-manifest")
        if barrier is not None:
            barrier()
        elif rank == 0:
            _wait_for_ranks(staged, world_size)
        if rank == 0:
            meta = {
                "format": FORMAT,
                "iteration": iteration,
                "world_size": world_size,
                "streaming": streaming,
                "dtype": dtype_flag(model_state),
            }
            if model_config is not None:
                meta["model"] = model_config
            publish.write_checked_json(os.path.join(staged, META), meta)
            kill_point("save-meta")
            publish.publish(directory)
    except BaseException as e:
        _discard(directory, rank, e)
        raise
    if barrier is not None:
        barrier()


def _discard(directory: str, rank: int, error: BaseException | None = None) -> None:
    """Leave nothing half-written: the staged dir goes (the next save or load would
    discard it anyway); the previous checkpoint at DIR is untouched. Another rank leaves
    why its part failed, for rank 0's ``_wait_for_ranks``, which has no collective to
    learn it by (``--async-save``)."""
    staged = os.path.realpath(directory) + publish.NEW_SUFFIX
    if rank == 0:
        if os.path.isdir(staged):
            publish.discard(staged)
        return
    mine = rank_path(staged, rank)
    if error is not None and os.path.isdir(mine):
        try:
            with open(os.path.join(mine, FAILED), "w", encoding="utf-8") as f:
                f.write(one_line(error))
        except OSError:
            pass  # the dir went meanwhile (rank 0 discarded it): nothing is waiting for this


def _wait_for_ranks(staged: str, world_size: int) -> None:
    """Until every rank's manifest is in ``staged`` (each rank writes its own last); a
    rank whose part failed stops the wait with its reason."""
    for rank in range(world_size):
        mine = rank_path(staged, rank)
        while not os.path.exists(os.path.join(mine, MANIFEST)):
            try:
                with open(os.path.join(mine, FAILED), encoding="utf-8") as f:
                    why = f.read()
            except FileNotFoundError:
                time.sleep(0.05)
                continue
            raise CheckpointError(
                f"{staged}: rank {rank}'s part of the save failed ({why}); nothing was published, "
                "the previous checkpoint stays"
            )


# -- load ------------------------------------------------------------------------------
def _dtype_refusal(directory: str, saved: str, ours: str) -> str:
    return (
        f"--load {directory}: the weights were saved as {saved} (--dtype {saved}), this run has --dtype {ours}: "
        f"resume with --dtype {saved} (casting them would change the model without a word)"
    )


def apply_run_hyperparameters(optimizer, directory: str, **flags: float) -> None:
    """Give every param group this run's ``--lr``/``--weight-decay`` (``flags``, by group
    key) after a load restored the checkpoint's, saying which value replaced which: a
    flag given on resume is never ignored without a word."""
    for key, value in flags.items():
        saved = sorted({group[key] for group in optimizer.param_groups if group[key] != value})
        if saved:
            log.warning(
                f"--{key.replace('_', '-')} {value:g}: replaces the {key.replace('_', ' ')} "
                f"{', '.join(f'{v:g}' for v in saved)} that {directory} was saved with"
            )
        for group in optimizer.param_groups:
            group[key] = value


def read_meta(directory: str) -> dict:
    path = os.path.join(directory, META)
    meta = publish.read_checked_json(path, _META_FIELDS)
    if meta["format"] != FORMAT:
        raise CheckpointError(f"{path}: format {meta['format']}, this greenroom reads format {FORMAT}")
    return meta


def settle(directory: str) -> None:
    """Finish or discard what killed saves left at ``directory`` (a root's iteration dirs,
    or one checkpoint dir; rank 0, before any rank loads), saying which."""
    for said in rotation.settle(os.path.realpath(directory)):
        log.warning(f"--load {directory}: {said}")


def verify(
    directory: str,
    *,
    optimizer,
    streaming: bool,
    no_load_optim: bool,
    rank: int,
    world_size: int,
    dtype: str | None = None,
    model: dict | None = None,
) -> dict:
    """Check the meta, this rank's manifest and every file it names (and the streamed
    state's own files) before anything is loaded; returns the meta. ``dtype``: this
    run's ``--dtype``, which must be the one the weights were saved in; ``model``: this
    run's model sizes (``model_config``), which must be the saved ones."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"--load {directory}: no such checkpoint dir")
    if publish.generation(directory) is None:
        raise CheckpointError(
            f"--load {directory}: no valid {publish.GENERATION} (not a greenroom train "
            "checkpoint, or its save did not finish)"
        )
    meta = read_meta(directory)
    if meta["world_size"] != world_size:
        raise CheckpointError(
            f"--load {directory}: saved with {meta['world_size']} ranks, this run has "
            f"{world_size}; resume is same-topology only"
        )
    if dtype is not None and meta.get("dtype", dtype) != dtype:
        raise CheckpointError(_dtype_refusal(directory, meta["dtype"], dtype))
    saved_model = meta.get("model")  # absent in checkpoints written before it was recorded
    if model is not None and isinstance(saved_model, dict) and saved_model != model:
        differs = [k for k in sorted(set(saved_model) | set(model)) if saved_model.get(k) != model.get(k)]
        said = ", ".join(f"--{k.replace('_', '-')} {saved_model.get(k)} (this run {model.get(k)})" for k in differs)
        raise CheckpointError(
            f"--load {directory}: saved from another model: {said}; resume with the sizes it was saved with"
        )
    path = rank_path(directory, rank)
    manifest = publish.read_checked_json(os.path.join(path, MANIFEST), {"files": dict})
    files = manifest["files"]
    if not no_load_optim:
        if streaming and not meta["streaming"]:
            raise CheckpointError(
                f"--load {directory}: the checkpoint has no streamed optimizer state (saved without "
                "--stream-optimizer-state-to-disk); pass --no-load-optim to accept a fresh optimizer state"
            )
        if meta["streaming"] and not streaming:
            raise CheckpointError(
                f"--load {directory}: the optimizer state was streamed (saved with "
                "--stream-optimizer-state-to-disk); add that flag to resume it, or pass --no-load-optim"
            )
    for name, entry in files.items():
        file_path = os.path.join(path, name)
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("bytes"), int)
            or not isinstance(entry.get("crc32"), str)
        ):
            raise CheckpointError(f"{os.path.join(path, MANIFEST)}: the entry for {name!r} is malformed")
        if not os.path.isfile(file_path):
            raise CheckpointError(f"{file_path} is missing; the checkpoint is incomplete")
        size, crc = _crc32(file_path)
        if size != entry["bytes"]:
            raise CheckpointError(f"{file_path}: {size} bytes, the manifest says {entry['bytes']} (truncated?)")
        if crc != entry["crc32"]:
            raise CheckpointError(
                f"{file_path}: checksum {crc} does not match the manifest's {entry['crc32']}; "
                "the file is corrupt: restore it or load an older checkpoint"
            )
    if "model.pt" not in files:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)}: lists no model.pt; the checkpoint is damaged")
    if streaming and not no_load_optim:
        from greenroom.optim.checkpoint import save_load as optim_checkpoint

        optim_dir = os.path.join(path, "optim")
        optim_checkpoint.verify(optimizer, optim_dir, optim_checkpoint.read_manifest(optim_dir))
    return meta


def verify_for(
    directory: str, *, model, optimizer, streaming: bool, no_load_optim: bool, rank: int, world_size: int
) -> dict:
    """``verify`` for this run's model (its dtype and sizes); returns the meta."""
    return verify(
        directory,
        optimizer=optimizer,
        streaming=streaming,
        no_load_optim=no_load_optim,
        rank=rank,
        world_size=world_size,
        dtype=dtype_flag(model.state_dict()),
        model=model_config(model),
    )


def load(
    directory: str,
    *,
    model,
    optimizer,
    streaming: bool,
    no_load_optim: bool,
    rank: int,
    world_size: int,
    meta: dict | None = None,
) -> int:
    """Restore this rank's state from a checkpoint ``verify`` passed (``meta``: what it
    returned; None: verified here first); returns the iteration to continue from."""
    weights = model.state_dict()
    ours = dtype_flag(weights)
    if meta is None:
        meta = verify_for(
            directory,
            model=model,
            optimizer=optimizer,
            streaming=streaming,
            no_load_optim=no_load_optim,
            rank=rank,
            world_size=world_size,
        )
    path = rank_path(directory, rank)
    state = torch.load(os.path.join(path, "model.pt"), weights_only=True)
    extra = sorted(set(state) - set(weights))
    if extra:
        raise CheckpointError(
            f"{os.path.join(path, 'model.pt')}: holds {extra[0]}"
            f"{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}, which this model does "
            "not have; the checkpoint is of another model (check --n-layers etc.)"
        )
    with torch.no_grad():
        for name, t in weights.items():
            if name not in state or state[name].shape != local_tensor(t).shape:
                raise CheckpointError(
                    f"{os.path.join(path, 'model.pt')}: {name} is missing or has another "
                    "shape; the checkpoint is of another model (check --d-model etc.)"
                )
            if state[name].dtype != local_tensor(t).dtype:  # a checkpoint whose meta predates "dtype"
                raise CheckpointError(
                    _dtype_refusal(directory, _DTYPE_FLAGS.get(state[name].dtype, str(state[name].dtype)), ours)
                )
            local_tensor(t).copy_(state[name])
    if no_load_optim:
        log.warning(f"--no-load-optim: starting a fresh optimizer state instead of the one in {directory}")
        if streaming:
            optimizer.initialize_state()  # its masters were filled from the weights before they loaded
    elif streaming:
        optimizer.load_checkpoint(os.path.join(path, "optim"))
    else:
        optimizer.load_state_dict(torch.load(os.path.join(path, "optim.pt"), weights_only=False))
        # Storages torch.load made are not resizable: own copies let offload free them.
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.clone()
    return meta["iteration"]
