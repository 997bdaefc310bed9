"""megatron-core integration: stream a DistributedOptimizer's fp32 mains and Adam moments.

    with greenroom.megatron.streaming(config, rank_dir):
        optimizer = get_megatron_optimizer(optimizer_config, model_chunks)
    ...
    greenroom.megatron.save_checkpoint(optimizer, checkpoint_dir)      # beside megatron's save
    greenroom.megatron.load_checkpoint(optimizer, checkpoint_dir, no_load_optim=False)

The state lives in the bucket files of greenroom.optim's engine. See docs/megatron.md.
"""

from greenroom.megatron.block import close, streaming, streaming_members
from greenroom.megatron.checkpoint import load_checkpoint, save_checkpoint
from greenroom.megatron.class_swap import StreamingSettings
from greenroom.megatron.optimizer import StreamingDistributedOptimizer
from greenroom.megatron.save_strategy import StreamedSaveStrategy
from greenroom.megatron.staging import DECODE_IN_SAVE
from greenroom.optim.store.bucket_store import DEFAULT_BUCKET_NUMEL

__all__ = [
    "DECODE_IN_SAVE",
    "DEFAULT_BUCKET_NUMEL",
    "StreamingDistributedOptimizer",
    "StreamedSaveStrategy",
    "StreamingSettings",
    "close",
    "load_checkpoint",
    "save_checkpoint",
    "streaming",
    "streaming_members",
]
