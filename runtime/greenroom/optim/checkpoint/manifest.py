"""What a checkpoint of the streamed state is: its files, its manifest, and the protocol
through which the checkpoint code reads and restores an optimizer.

A checkpoint is a directory::

    manifest.json      format version, dtypes, bucket layout, topology, steps, checksums
    bucket-NNNNN.bin   the live bucket files' bytes (their inodes, clones or copies)
    resident.pt        step counters and the resident (tiny fp32) params' moments

Every save ends in ``finish_checkpoint`` (``save_load`` between steps, ``instep`` in the
step's own pass), which writes ``resident.pt`` and the manifest and publishes the staged
dir. ``read_manifest`` is the one reader of a manifest: what it returns has every field a
load uses, of the type it uses (``checks`` compares them with the optimizer).

The optimizer is read and restored only through ``StreamedState``, which ``StreamingAdam``
and greenroom.megatron's ``StreamingDistributedOptimizer`` implement.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Protocol

import torch

from greenroom.dirs.tree import write_json_atomic
from greenroom.errors import CheckpointError
from greenroom.io import publish
from greenroom.optim.checkpoint.filecopy import file_crc32

if TYPE_CHECKING:
    from greenroom.optim.store.bucket_store import BucketStore

MANIFEST = "manifest.json"
RESIDENT = "resident.pt"
FORMAT = "greenroom-streamed-adam"
VERSION = 1


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


def bucket_file_name(store: BucketStore, index: int) -> str:
    """The name bucket ``index``'s file has in the state dir and in a checkpoint."""
    return os.path.basename(store.path(index))


# -- writing and reading the manifest -------------------------------------------------
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
