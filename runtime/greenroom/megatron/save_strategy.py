"""``StreamedSaveStrategy``: megatron-core's ``torch_dist`` save, writing the streamed
state of bucket files that are not fp32 tensors once.

Such a bucket (compressed frames, narrow moments) is decoded into an fp32 file of its own
for a stock-format save, which megatron's writer then copies into the checkpoint: the
state's fp32 bytes are written twice. Saved through this strategy, with the optimizer's
sharded state dict built for it, they are written once (staging Note [decode in the save]):

    from megatron.core import dist_checkpointing
    from greenroom.megatron import DECODE_IN_SAVE, StreamedSaveStrategy

    metadata = {"distrib_optim_sharding_type": "dp_reshardable", DECODE_IN_SAVE: True}
    model_sd = model.sharded_state_dict()
    state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, metadata=metadata)}
    dist_checkpointing.save(state, ckpt, sharded_strategy=StreamedSaveStrategy())

The checkpoint is the one stock's strategy writes, in torch DCP's own format: stock
megatron-core reads it, at any layout its format reshards to. Everything but the streamed
state's deferred items is megatron's: the planning, the writer of the other items (async
included), the metadata its finalization writes.
"""

from __future__ import annotations

import os
import queue
from collections import defaultdict

import torch
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from greenroom.errors import CheckpointError
from greenroom.megatron.staging import deferred_source


class StreamedSaveStrategy(TorchDistSaveShardedStrategy):
    """megatron-core's ``TorchDistSaveShardedStrategy`` (same arguments, ``torch_dist``
    version 1 by default) that decodes and writes the items of deferred buckets itself,
    one bucket at a time, before megatron's writer is handed the rest. For a save with no
    deferred bucket it is megatron's strategy unchanged. Async saves: those items are
    written before ``async_save`` returns, as a decoding save writes its fp32 files before
    ``dist_checkpointing.save`` is called; the rest goes to megatron's async writer."""

    def __init__(self, backend: str = "torch_dist", version: int = 1, **kwargs) -> None:
        super().__init__(backend, version, **kwargs)

    # megatron calls this with the writer its planning has prepared (write_buckets
    # resolved), before it builds the save function from them: the one point where the
    # planned items can be split between greenroom and megatron's writer.
    def _get_save_and_finalize_callbacks(self, writer, *args, **kwargs):
        ours = _take_deferred(writer)
        if ours:
            _hand_back(writer, _write(writer, ours))
        return super()._get_save_and_finalize_callbacks(writer, *args, **kwargs)


def _take_deferred(writer) -> dict:
    """Remove the items of meta tensors from ``writer``'s buckets; per (save, bucket) the
    items, each with its elements' start and count in the bucket's fp32 layout."""
    ours: dict = defaultdict(list)
    kept = []
    for path, name, (byte_items, tensor_items) in writer.write_buckets:
        theirs = []
        for item, tensor in tensor_items:
            if tensor.device.type != "meta":
                theirs.append((item, tensor))
                continue
            views, index, start, numel = deferred_source((item.index.fqn, tuple(item.index.offset)))
            if numel != tensor.numel():
                raise CheckpointError(f"{item.index.fqn}: a planned item of {tensor.numel()} elements, {numel} noted")
            ours[(views, index)].append((item, start, tensor.shape))
        if byte_items or theirs:
            kept.append((path, name, (byte_items, theirs)))
    if ours:
        writer.write_buckets = kept
        if not kept:  # nothing left for megatron's writer, whose results then come from no queue
            writer.results_queue = None
    return ours


def _write(writer, ours: dict) -> list:
    """Decode each bucket and write its items into a file of the checkpoint of its own
    with megatron's item writer (the format and fsync of its other files); their results."""
    if getattr(writer, "use_msc", False):
        raise CheckpointError("StreamedSaveStrategy writes local files only: the multi-storage client is enabled")
    transforms = [writer.transforms] if hasattr(writer, "transforms") else []
    rank = torch.distributed.get_rank()
    results = []
    for n, ((views, index), items) in enumerate(ours.items()):
        with views.decoded(index) as get:
            data = [(item, get(start, shape.numel()).view(shape)) for item, start, shape in items]
        name = f"__{rank}_greenroom{n}.distcp"
        got, done = queue.Queue(), queue.Queue()
        done.put(n)
        FileSystemWriterAsync.write_preloaded_data(
            transforms, n, (os.path.join(writer.checkpoint_dir, name), name, ([], data)), got, done, True
        )
        del data
        _, written = got.get_nowait()
        if isinstance(written, Exception):
            raise CheckpointError(f"{os.path.join(writer.checkpoint_dir, name)}: {written}") from written
        results.extend(written)
    return results


def _hand_back(writer, results: list) -> None:
    """Add ``results`` to what ``writer`` reports to megatron's finalization, which puts
    every item's file and offset into the checkpoint's metadata."""
    retrieve = writer.retrieve_write_results

    def with_ours():
        theirs = retrieve()
        return theirs + results if isinstance(theirs, list) else theirs

    writer.retrieve_write_results = with_ours
