"""``greenroom.megatron.streaming()``: the block inside which megatron-core builds
``StreamingDistributedOptimizer`` (``greenroom.megatron.optimizer``) for its
DistributedOptimizer, and the streaming members of what it built.
"""

from __future__ import annotations

import contextlib
import os

from greenroom.config import OffloadConfig
from greenroom.dirs.rankdir import RankDir
from greenroom.dirs.roots import check_root
from greenroom.errors import ConfigError
from greenroom.io.compression import ResolvedCodec
from greenroom.megatron.class_swap import WHAT, StreamingSettings, swapped
from greenroom.megatron.optimizer import StreamingDistributedOptimizer
from greenroom.optim.store.bucket_store import DEFAULT_BUCKET_NUMEL


@contextlib.contextmanager
def streaming(
    config: OffloadConfig,
    rank_dir,
    *,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    compression: ResolvedCodec | None = None,
):
    """Every DistributedOptimizer megatron-core builds inside this block streams its state.

        with greenroom.megatron.streaming(config, rank_dir):
            optimizer = get_megatron_optimizer(optimizer_config, model_chunks)

    While the block lasts megatron's ``DistributedOptimizer`` name means the streaming
    subclass (``greenroom.megatron.class_swap`` Note [the class swap]); the optimizer
    objects it returns are ordinary DistributedOptimizers (and ChainedOptimizers of them)
    to the rest of megatron.

    ``rank_dir`` is this rank's open ``RankDir``, or a plain path: then this rank's own
    rank dir is made under it (``greenroom.dirs.statedir``) and removed when the last of the
    block's optimizers is ``close()``d (or at exit).

    ``compression``: the codec the run resolved for ``config`` on CUDA
    (``greenroom.io.compression.resolve``); None: the block resolves the config's choice once.
    """
    settings = StreamingSettings(config=config, rank_dir=rank_dir, bucket_numel=bucket_numel, compression=compression)
    if not config.stream_optimizer_state_to_disk:
        raise ConfigError(
            "greenroom.megatron.streaming needs --stream-optimizer-state-to-disk "
            "(OffloadConfig.stream_optimizer_state_to_disk=True)"
        )
    if rank_dir is not None and not isinstance(rank_dir, RankDir):
        check_root(os.fspath(rank_dir), name=f"{WHAT}: state_dir")  # refused at once, made when needed
    import megatron.core.optimizer as mcore_optimizer

    try:
        with swapped(settings, mcore_optimizer, StreamingDistributedOptimizer):
            yield settings
    finally:
        if settings.opened is not None:
            settings.opened.close_if_unclaimed()  # every optimizer built failed: nothing keeps it


def streaming_members(optimizer) -> list[StreamingDistributedOptimizer]:
    """The streaming DistributedOptimizers inside ``optimizer`` (a chain or a single one)."""
    members = [
        m
        for m in getattr(optimizer, "chained_optimizers", [optimizer])
        if isinstance(m, StreamingDistributedOptimizer) and m._store is not None
    ]
    if not members:
        raise ConfigError("this optimizer does not stream: build it inside greenroom.megatron.streaming(...)")
    return members


def close(optimizer) -> None:
    """Drain and release the bucket stores of every streaming member of ``optimizer``
    (their files stay until the rank dir goes)."""
    for member in streaming_members(optimizer):
        member.close()


__all__ = ["close", "streaming", "streaming_members"]
