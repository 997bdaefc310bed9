"""The demo job's optimizer: ``StreamingAdam`` under ``--stream-optimizer-state-to-disk``,
else torch's AdamW of the same implementation, and the streamed state's byte counters."""

from __future__ import annotations

import torch

from greenroom.config import OffloadConfig
from greenroom.dirs.rankdir import RankDir
from greenroom.errors import GreenroomError
from greenroom.io.compression import ResolvedCodec
from greenroom.train.config import TrainConfig
from greenroom.train.saving import SaveSettings, saved_bucket_numel


def build_optimizer(
    params: list[torch.nn.Parameter],
    config: TrainConfig,
    offload: OffloadConfig,
    rank_dir: RankDir | None,
    *,
    save_settings: SaveSettings,
    rank: int,
    compression: ResolvedCodec,
    device: torch.device,
) -> torch.optim.Optimizer:
    """The optimizer of ``params``; a streaming one keeps the bucket size of the checkpoint
    ``--load`` resumes from (``saving.saved_bucket_numel``)."""
    if offload.stream_optimizer_state_to_disk:
        try:
            from greenroom.optim import StreamingAdam
        except ImportError:
            raise GreenroomError(
                "--stream-optimizer-state-to-disk needs greenroom.optim.StreamingAdam, which this install lacks"
            ) from None
        layout = {}
        saved = saved_bucket_numel(save_settings, rank)
        if saved is not None:
            layout["bucket_numel"] = saved
        return StreamingAdam.from_config(
            params,
            offload,
            rank_dir,
            lr=config.lr,
            weight_decay=config.weight_decay,
            compression=compression,
            **layout,
        )
    # The same implementation StreamingAdam uses (fused on CUDA, foreach elsewhere), so
    # fp32 streaming on or off trains bit-identically.
    cuda = device.type == "cuda"
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, fused=cuda, foreach=not cuda)


def stream_counters(optimizer) -> dict[str, int]:
    """The streamed state's bytes moved so far: the state's (``read``/``written``) and
    the disk's (less what compression saved); zeros for an optimizer that does not stream."""
    store = getattr(optimizer, "store", None)
    if store is None:
        return dict.fromkeys(
            ("stream_read_bytes", "stream_written_bytes", "stream_disk_read_bytes", "stream_disk_written_bytes"), 0
        )
    return {
        "stream_read_bytes": store.bytes_read,
        "stream_written_bytes": store.bytes_written,
        "stream_disk_read_bytes": store.disk_bytes("read"),
        "stream_disk_written_bytes": store.disk_bytes("written"),
    }
