"""The shape one value of a Slurm job YAML must have, each checked in one place: a
positive or non-negative count, one ``#SBATCH`` word, a ``--time``, a ``--mem`` size, an
environment name and the node-local scratch dir; and a field's unit for the reference.

Values that end up on ``#SBATCH`` lines are checked to be single shell-safe words:
``sbatch`` parses those lines itself, not through a shell, so quoting cannot save a
value with spaces there. Values that end up in shell commands are quoted with
``shlex.quote`` by ``greenroom.slurm.render``.
"""

from __future__ import annotations

import os
import re

from greenroom.errors import ConfigError
from greenroom.io import fs

# One #SBATCH word: what partition, account, QoS, job and node names are made of.
SBATCH_WORD = re.compile(r"^[A-Za-z0-9_.,:=%@/+\-\[\]]+$")
MEMORY = re.compile(r"^[0-9]+[KMGT]?$")
# Slurm's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
TIME = re.compile(
    r"^(?:(?P<d>[0-9]+)-(?P<dh>[0-9]+)(?::(?P<dm>[0-9]+)(?::(?P<ds>[0-9]+))?)?"
    r"|(?P<a>[0-9]+)(?::(?P<b>[0-9]+)(?::(?P<c>[0-9]+))?)?)$"
)
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def unit(unit: str) -> dict:
    """A field's unit, for the config reference in docs/slurm.md (greenroom.slurm.reference)."""
    return {"unit": unit}


def check_scratch_dir(path: str) -> None:
    """Refuse a relative or memory-backed scratch dir (tmpfs keeps the data in RAM)."""
    if not isinstance(path, str) or not os.path.isabs(path):
        raise ConfigError(f"scratch_dir: expected an absolute path on node-local NVMe, got {path!r}")
    if fs.is_memory_backed(path):
        mount = fs.mount_of(path)
        raise ConfigError(
            f"scratch_dir: {path} is on {mount.fstype} ({mount.mount_point}), which keeps the "
            "offloaded data in RAM; point it at node-local NVMe"
        )


def time_minutes(value: str) -> int:
    """Minutes in a Slurm ``--time`` value (rounded up), validating it."""
    m = TIME.match(str(value))
    if not m:
        raise ConfigError(f"time: expected a Slurm time like 04:00:00 or 1-12:00:00, got {value!r}")
    if m["d"] is not None:
        seconds = ((int(m["d"]) * 24 + int(m["dh"])) * 60 + int(m["dm"] or 0)) * 60 + int(m["ds"] or 0)
    elif m["c"] is not None:
        seconds = (int(m["a"]) * 60 + int(m["b"])) * 60 + int(m["c"])
    else:
        seconds = int(m["a"]) * 60 + int(m["b"] or 0)
    if seconds <= 0:
        raise ConfigError(f"time: must be longer than zero, got {value!r}")
    return -(-seconds // 60)


def positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def non_negative_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")


def sbatch_word(name: str, value) -> None:
    if not isinstance(value, str) or not SBATCH_WORD.match(value):
        raise ConfigError(
            f"{name}: {value!r} must be one word of letters, digits and _.,:=%@/+-[] (it goes on an #SBATCH line)"
        )
