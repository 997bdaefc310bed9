"""``StreamingCheckpointIO``: Lightning's checkpoint I/O without a host copy of the state.

Lightning's ``TorchCheckpointIO`` serializes the whole checkpoint into an in-memory
buffer before writing it, and loads without ``mmap``. With ``StreamingAdam``, whose
state dict is views of its bucket files, that buffer is the one host copy of the state.
This plugin writes with ``torch.save`` straight to a file beside the checkpoint, fsyncs
it and renames it into place (as atomic as Lightning's own), and loads with
``torch.load(mmap=True)``. Host RSS then stays within the bound of docs/streaming.md::

    trainer = lightning.Trainer(..., plugins=[StreamingCheckpointIO()])

Local paths only. Importing this module imports Lightning.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from greenroom.dirs.roots import check_root
from greenroom.errors import ConfigError


class StreamingCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that writes and reads checkpoint files directly."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("StreamingCheckpointIO.save_checkpoint: storage_options are not supported")
        path = _local(path)
        # A dir this user cannot write is one line before any byte is serialized; missing
        # parents are made with the default mode, and nothing that exists is changed.
        check_root(os.path.dirname(os.path.abspath(path)), name="StreamingCheckpointIO: checkpoint dir")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            torch.save(checkpoint, tmp)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def load_checkpoint(self, path, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        path = _local(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return torch.load(path, map_location=map_location, weights_only=weights_only, mmap=True)


def _local(path) -> str:
    path = os.fspath(path)
    if "://" in path:
        raise ConfigError(
            f"StreamingCheckpointIO: {path} is not a local path; it writes local files only "
            "(use Lightning's default CheckpointIO for remote storage)"
        )
    return path


__all__ = ["StreamingCheckpointIO"]
