"""A ``streaming()`` block's settings (``StreamingSettings``: the config, the dir its
optimizers claim theirs under, the bucket size, the codec resolved once for the block),
and the swap of megatron-core's ``DistributedOptimizer`` name that has megatron build the
streaming class with them (Note [the class swap])."""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from dataclasses import dataclass

from greenroom.config import OffloadConfig
from greenroom.dirs.rankdir import RankDir, held_rank_dir
from greenroom.dirs.statedir import StateDir, claim_state_dir, open_rank_dir
from greenroom.errors import ConfigError
from greenroom.io.compression import ResolvedCodec, resolved
from greenroom.optim.store.bucket_store import DEFAULT_BUCKET_NUMEL

WHAT = "greenroom.megatron.streaming"  # how refusals name the caller


@dataclass(kw_only=True, slots=True)
class StreamingSettings:
    """How one DistributedOptimizer streams its state."""

    config: OffloadConfig
    """The validated flags (moment dtype, chunk size, disk dir)."""

    rank_dir: RankDir | str | os.PathLike | None
    """This rank's open ``greenroom.dirs.rankdir.RankDir``, or a plain path (None: the config's
    disk dir) under which the block's first optimizer makes this rank's own rank dir; each
    optimizer of the block claims a subdir of it (``optim/``, ``optim-2/``, ...)."""

    bucket_numel: int = DEFAULT_BUCKET_NUMEL
    """Elements per bucket, independent of DDP's buckets; a larger shard is its own."""

    opened: RankDir | None = None
    """The rank dir the block made under a plain path, if it made one."""

    compression: str | ResolvedCodec | None = None
    """The codec the run resolved for the config (None: the config's choice), resolved
    once for the block by its first optimizer (``codec``)."""

    def __post_init__(self) -> None:
        if isinstance(self.bucket_numel, bool) or not isinstance(self.bucket_numel, int) or self.bucket_numel <= 0:
            raise ConfigError(f"bucket_numel must be a positive integer, got {self.bucket_numel!r}")

    def codec(self) -> ResolvedCodec:
        """The block's codec, resolved once (on CUDA): every optimizer of a chain writes with it."""
        self.compression = resolved(
            self.compression or self.config.offload_train_disk_compression,
            cuda=True,
            chunk_bytes=self.config.chunk_bytes,
            what=WHAT,
        )
        return self.compression

    def claim(self) -> StateDir:
        """A dir for one more optimizer of the block (made when the first needs it, so a
        block that builds none makes nothing)."""
        given = self.config.offload_train_disk_dir if self.rank_dir is None else self.rank_dir
        if isinstance(given, RankDir):
            return claim_state_dir(given, name="optim", what=WHAT)
        if given is None:
            raise ConfigError(f"{WHAT}: no dir for the state: pass rank_dir, or set --offload-train-disk-dir")
        holder = held_rank_dir(os.fspath(given)) or self.opened
        if holder is None:
            self.opened = holder = open_rank_dir(given, role="optim", what=WHAT)
        return claim_state_dir(holder, name="optim", what=WHAT)


_SETTINGS: contextvars.ContextVar = contextvars.ContextVar("greenroom_megatron_settings", default=None)

# Note [the class swap]: megatron-core (0.16.1, and its main branch as of 2026-12) builds
# its DistributedOptimizer by calling the name ``DistributedOptimizer`` of
# ``megatron.core.optimizer`` inside a private helper of ``get_megatron_optimizer``, and
# offers no setting or hook for the class. The other ways in are worse: building the optimizer ourselves means copying
# get_megatron_optimizer (its process groups, dense/expert split and chaining) and calling
# its private helpers, whose signatures change between releases; converting a stock
# optimizer afterwards means all its fp32 mains were on the GPU at once, the peak the
# bounded initialization exists to avoid. So ``streaming()`` rebinds that one name for
# the length of the block and restores it in a ``finally``, whatever construction
# raised. The name is process-wide: blocks in several threads take a lock and run one
# after another (a nested block in one thread restores what it found), and a thread that
# builds a megatron optimizer outside any block while another is inside one gets the
# streaming class, which refuses in one line because that thread has no settings.
_SWAP_LOCK = threading.RLock()
_swapping_thread: int | None = None  # the thread inside a streaming() block, if any


def current_settings() -> StreamingSettings | None:
    """The settings of the ``streaming()`` block this thread is inside, if any."""
    return _SETTINGS.get()


def swapping_in_another_thread() -> bool:
    """Whether another thread is inside a ``streaming()`` block (so megatron builds the
    streaming class in this one too, without settings)."""
    return _swapping_thread not in (None, threading.get_ident())


@contextlib.contextmanager
def swapped(settings: StreamingSettings, mcore_optimizer, streaming_class: type):
    """For the block: ``mcore_optimizer.DistributedOptimizer`` is ``streaming_class``,
    built with ``settings`` (Note [the class swap])."""
    global _swapping_thread
    with _SWAP_LOCK:
        outer = _swapping_thread
        _swapping_thread = threading.get_ident()
        token = _SETTINGS.set(settings)
        saved = mcore_optimizer.DistributedOptimizer
        mcore_optimizer.DistributedOptimizer = streaming_class
        try:
            yield settings
        finally:
            mcore_optimizer.DistributedOptimizer = saved
            _SETTINGS.reset(token)
            _swapping_thread = outer
