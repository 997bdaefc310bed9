"""The names in a rank dir's tree, ``<root>/<job>/<role>/rank<NNNNN>/``, and the one rule
for each: the job id, a dir level, a rank dir's last level, a claim's subdir, the owner
record's match with its path, and the files greenroom keeps in the tree (``greenroom.dirs.rankdir``
holds the dir itself; these are what reclaim, the launch env and the Slurm renderer share).
"""

from __future__ import annotations

import os
import uuid

from greenroom.errors import ConfigError

LOCK_NAME = ".lock"
# What a rank dir is renamed to while it is deleted (``greenroom.dirs.rankdir`` Note [closing aside]); ``greenroom
# reclaim`` finishes one whose deleter was killed.
TRASH_PREFIX = ".greenroom-reclaim-"
OWNER_NAME = "owner.json"
# In each <job> and <role> dir greenroom made itself (``greenroom.dirs.tree`` Note [made parents]).
MADE_NAME = ".greenroom-made"
DIR_MODE = 0o700

# Without a scheduler each process is its own job, the same one for all of its rank dirs
# (so two owners of one path in one process meet at the lock).
_LOCAL_JOB = f"local-{uuid.uuid4().hex[:12]}"


def job_id() -> str:
    """The id that groups one job's ranks: the scheduler's where there is one."""
    for var in ("GREENROOM_JOB_ID", "SLURM_JOB_ID"):
        if os.environ.get(var):
            return os.environ[var]
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run and run != "none":
        return f"torchrun-{run}"
    return _LOCAL_JOB


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def is_rank_dir_record(path: str, owner: dict) -> bool:
    """Whether ``owner``, read from ``path``'s owner record, is one ``RankDir`` wrote for
    that path: ``<job>/<role>/rank<N>`` named in it (``greenroom reclaim`` deletes no
    other dir that happens to hold an ``owner.json``)."""
    name = os.path.basename(path)
    rank = owner.get("rank")
    role_dir = os.path.dirname(path)
    return (
        name.startswith("rank")
        and name[4:].isdigit()
        and isinstance(rank, int)
        and not isinstance(rank, bool)
        and name == rank_dir_name(rank)
        and owner.get("role") == os.path.basename(role_dir)
        and owner.get("job") == os.path.basename(os.path.dirname(role_dir))
    )


def is_dir_name(value) -> bool:
    """Whether ``value`` names one new directory level: not empty, no ``/``, and not
    ``.`` or ``..`` (they name a dir that exists already, so two roles or jobs would share)."""
    return isinstance(value, str) and bool(value) and "/" not in value and value not in (".", "..")


def rank_dir_name(rank: int) -> str:
    """The last level of a rank dir's path: ``rank<NNNNN>``."""
    return f"rank{rank:05d}"


def claim_name(name: str, n: int) -> str:
    """The subdir the ``n``-th claim of ``name`` in one rank dir gets: ``name`` itself for
    the first, then ``name-2``, ``name-3``... (``greenroom.dirs.rankdir`` Note [claims])."""
    return name if n == 1 else f"{name}-{n}"


def rank_dir_path(root: str, job: str, role: str, rank: int) -> str:
    for name, value in (("the job id (from $GREENROOM_JOB_ID, $SLURM_JOB_ID or torchrun)", job), ("--role", role)):
        if not is_dir_name(value):
            raise ConfigError(f"{name}: {value!r} is not a valid directory name")
    return os.path.join(root, job, role, rank_dir_name(rank))
