"""Where one owner (an optimizer, an offloader) keeps its files, whatever the caller passed.

A caller hands ``StreamingAdam``, ``build_offloader`` or ``greenroom.megatron.streaming``
either an open ``RankDir`` or a plain path. Both end the same way (one owner per dir,
enforced by the rank dir's lock):

- a ``RankDir``: the owner claims a subdir of its own (``optim``, ``optim-2``, ...);
- a path inside a rank dir this process holds: that path, claimed once;
- any other path is a root: this process opens its own rank dir under it,
  ``<path>/<job>/<role>/rank<N>`` with N this process's rank (torch.distributed's, else
  ``$RANK``, else ``$LOCAL_RANK``, else 0), so the ranks of a job that all run the same
  line get a dir each. It has what every rank dir has: the lock (a second owner of the
  same job, role and rank is refused in one line naming the holder), the tmpfs refusal,
  the owner record ``greenroom reclaim`` goes by after a crash, removal at exit and on
  SIGTERM; and it is removed when its owner closes.

The root is never changed (``greenroom.dirs.rankdir`` Note [what greenroom creates]). This
module must not import torch (it reads torch.distributed only when the caller did).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from greenroom.dirs.rankdir import RankDir, held_rank_dir
from greenroom.dirs.roots import check_root
from greenroom.errors import ConfigError
from greenroom.ranks import process_rank


@dataclass
class StateDir:
    """A claimed dir: ``path`` holds the owner's files; ``release()`` when the owner closes."""

    path: str
    rank_dir: RankDir

    def release(self) -> None:
        self.rank_dir.release(self.path)


def open_rank_dir(state_dir: str | os.PathLike, *, role: str, what: str) -> RankDir:
    """This process's rank dir under the plain path ``state_dir`` (see the module doc),
    open and closing itself with its last claim."""
    root = os.path.abspath(os.fspath(state_dir))
    check_root(root, name=f"{what}: state_dir")
    try:
        rank_dir = RankDir(root, role=role, rank=process_rank()).open()
    except ConfigError as e:  # the tmpfs refusal, named as the caller knows the path
        raise ConfigError(f"{what}: state_dir {e}") from None
    rank_dir.close_with_last_claim = True
    return rank_dir


def claim_state_dir(state_dir: str | os.PathLike | RankDir, *, name: str, what: str) -> StateDir:
    """The dir ``what`` (e.g. ``"StreamingAdam"``) keeps its files in, claimed for it alone.

    ``name`` is the subdir (and, under a plain path, the role) it claims.
    """
    if isinstance(state_dir, RankDir):
        return StateDir(state_dir.claim(name), state_dir)
    if not isinstance(state_dir, (str, os.PathLike)):
        raise ConfigError(f"{what}: state_dir must be a path or a greenroom RankDir, got {type(state_dir).__name__}")
    holder = held_rank_dir(os.fspath(state_dir))
    if holder is not None:
        return StateDir(holder.claim_path(os.fspath(state_dir)), holder)
    rank_dir = open_rank_dir(state_dir, role=name, what=what)
    try:
        return StateDir(rank_dir.claim(name), rank_dir)
    except BaseException:
        rank_dir.close()
        raise


__all__ = ["StateDir", "claim_state_dir", "open_rank_dir"]
