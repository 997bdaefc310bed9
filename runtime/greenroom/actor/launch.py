"""How an actor process must start to run on torch_memory_saver, and the check that the
installed torch_memory_saver can do what we ask of it.

torch_memory_saver's preload mode replaces ``cudaMalloc`` through ``LD_PRELOAD``, so the
environment has to be right before the process starts: ``launch_env`` computes it and
``relaunch_with`` re-executes the current command under it (same pid, so torchrun and
Slurm keep tracking the rank). Nothing here imports torch_memory_saver: on a machine
without CUDA it cannot even be loaded, and the checks only read files.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

from greenroom.config import OffloadConfig
from greenroom.dirs.names import claim_name, job_id, rank_dir_path
from greenroom.errors import ConfigError, GreenroomError

PACKAGE = "torch_memory_saver"
HOOK_STEM = "torch_memory_saver_hook_mode_preload"
# The symbol a hook must know for disk backup; 0.0.9.post1 lacks it and silently keeps
# the memory nowhere, which shows up as NaNs after the first wake.
DISK_SUPPORT_MARKER = b"TMS_INIT_ENABLE_DISK_BACKUP"
MOVERS = ("greenroom", "tms")
RELAUNCHED = "GREENROOM_ACTOR_RELAUNCHED"
MOVER_VAR = "GREENROOM_ACTOR_MOVER"


def site_dir() -> str:
    """The directory torch_memory_saver is installed in (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GreenroomError(
            "torch_memory_saver is not installed: pip install torch-memory-saver==0.0.10 "
            "(or run without CUDA, where the portable backend is used)"
        )
    return os.path.dirname(list(spec.submodule_search_locations)[0])


def installed_version(site: str) -> str:
    found = sorted(glob.glob(os.path.join(site, f"{PACKAGE}-*.dist-info")))
    return os.path.basename(found[-1])[len(PACKAGE) + 1 : -len(".dist-info")] if found else "unknown"


def hook_library(cuda_major: int, site: str | None = None) -> str:
    """Path of the preload hook built for this CUDA major (cu12 or cu13)."""
    site = site or site_dir()
    name = f"{HOOK_STEM}_cu{cuda_major}.abi3.so"
    for candidate in (os.path.join(site, PACKAGE, name), os.path.join(site, name)):
        if os.path.isfile(candidate):
            return candidate
    raise GreenroomError(
        f"torch_memory_saver {installed_version(site)} in {site} has no {name} for CUDA "
        f"{cuda_major}: install torch-memory-saver==0.0.10, which ships cu12 and cu13 hooks"
    )


def check_disk_support(hook: str) -> None:
    """Refuse a hook that does not know disk backup (it would ignore the setting)."""
    with open(hook, "rb") as f:
        supported = DISK_SUPPORT_MARKER in f.read()
    if not supported:
        site = os.path.dirname(hook)
        if os.path.basename(site) == PACKAGE:
            site = os.path.dirname(site)
        raise GreenroomError(
            f"torch_memory_saver {installed_version(site)} at {hook} does not support disk backup "
            f"(no {DISK_SUPPORT_MARKER.decode()}): it would ignore --offload-train-target disk and the run "
            "would read garbage after the first wake; install torch-memory-saver==0.0.10"
        )


def torch_cuda_major() -> int | None:
    """torch's CUDA major where a GPU is there to use; None on a CPU build, and on a CUDA
    build without a usable GPU (PyPI's torch on a CPU machine), where the portable backend
    runs and the hook, which needs libcuda, must not be preloaded."""
    import torch

    if not torch.version.cuda or not torch.cuda.is_available():
        return None
    return int(torch.version.cuda.split(".")[0])


OFFLOAD_NAME = "offload"  # the subdir the offloader claims in its rank dir


def offload_dir(config: OffloadConfig, rank: int, *, role: str, job: str) -> str:
    """The rank's ``offload/`` dir: the path ``build_offloader`` claims in ``RankDir(...)``
    (the first claim of a name gets the name itself)."""
    return os.path.join(rank_dir_path(config.offload_train_disk_dir, job, role, rank), claim_name(OFFLOAD_NAME, 1))


def launch_env(
    config: OffloadConfig,
    rank: int,
    *,
    role: str = "actor",
    job: str | None = None,
    mover: str = "greenroom",
    cuda_major: int | None = None,
    site: str | None = None,
) -> dict[str, str]:
    """The environment an actor process must start with.

    Empty when nothing needs torch_memory_saver (``--offload-train`` off, or a torch
    without CUDA: the portable backend runs there). Otherwise ``LD_PRELOAD`` of the hook
    matching torch's CUDA major and the ``TMS_INIT_*`` settings: every device allocation
    of the process belongs to the pausable region from the first one on. ``mover``
    ``tms`` lets torch_memory_saver copy the memory itself (its pinned host or disk
    backup, ``TMS_DISK_BACKUP_DIR`` = the rank's ``offload/`` dir); ``greenroom`` (the
    default) has it only release and re-map the memory while greenroom's overlapped I/O
    layer moves the tracked state (see docs/offload.md).
    """
    if mover not in MOVERS:
        raise ConfigError(f"mover: expected one of {', '.join(MOVERS)}, got {mover!r}")
    if not config.offload_train:
        return {}
    cuda_major = torch_cuda_major() if cuda_major is None else cuda_major
    if cuda_major is None:
        return {}
    hook = hook_library(cuda_major, site)
    target = config.offload_train_target
    if target == "disk" and mover == "tms":
        check_disk_support(hook)
    job = job or job_id()
    others = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p and PACKAGE not in p]
    env = {
        "LD_PRELOAD": ":".join([hook, *others]),
        "TMS_INIT_ENABLE": "1",
        "TMS_INIT_ENABLE_CPU_BACKUP": "1" if (mover == "tms" and target == "cpu") else "0",
        "TMS_INIT_ENABLE_DISK_BACKUP": "1" if (mover == "tms" and target == "disk") else "0",
        # Same job id in the re-executed process, so it finds the dir named here.
        "GREENROOM_JOB_ID": job,
        MOVER_VAR: mover,
    }
    if target == "disk":
        env["TMS_DISK_BACKUP_DIR"] = offload_dir(config, rank, role=role, job=job)
        env["TMS_DISK_BACKUP_CHUNK_MB"] = str(config.offload_train_disk_chunk_mb)
    return env


def hooks_loaded() -> bool:
    """Whether this process started with a torch_memory_saver hook preloaded."""
    return PACKAGE in os.environ.get("LD_PRELOAD", "") and os.environ.get("TMS_INIT_ENABLE") == "1"


def relaunch_with(env: dict[str, str]) -> None:
    """Re-execute this very command under ``env`` unless it already runs under it."""
    if not env or all(os.environ.get(k) == v for k, v in env.items()):
        return
    if os.environ.get(RELAUNCHED):
        raise GreenroomError(
            f"the actor was relaunched but its environment still differs from {sorted(env)}: "
            "something rewrites LD_PRELOAD or TMS_* between exec and start"
        )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **env, RELAUNCHED: "1"})
