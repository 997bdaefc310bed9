"""The local Slurm cluster (scripts/services.d/slurm.sh) for the tests that submit to it:
a skip saying why where it (or the part a module needs) is not there, ``SLURM_CONF``
pointing at it while a module runs, and no job left running after a test.

A test module takes the fixtures by importing them (pytest uses the fixtures a module's
namespace holds) and records every job it submits in ``SUBMITTED``.
"""

import json
import os
import shutil
import subprocess

import pytest

from tests.conftest import REPO

CLUSTER = os.path.join(REPO, ".run", "slurm")
SLURM_CONF = os.path.join(CLUSTER, "slurm.conf")
SUBMITTED: list[str] = []  # the ids of the jobs the running test submitted


@pytest.fixture(autouse=True)
def cancel_leftover_jobs():
    """A failing test must not leave a run-forever job holding the node's CPUs."""
    yield
    while SUBMITTED:
        subprocess.run(["scancel", SUBMITTED.pop()], capture_output=True)


def local_cluster(marker: str, missing: str, *sinfo: str):
    """The body of a module's cluster fixture (``yield from`` it): skips unless sbatch is
    installed, the path ``marker`` exists (else the reason ``missing``) and ``sinfo
    *sinfo`` answers; meanwhile ``SLURM_CONF`` is the local cluster's (it reaches sbatch
    here and the jobs' own srun), restored after."""
    if shutil.which("sbatch") is None:
        pytest.skip("sbatch not installed: `make test` installs Slurm when run as root on Debian")
    if not os.path.exists(marker):
        pytest.skip(missing)
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = SLURM_CONF
    try:
        proc = subprocess.run(["sinfo", *sinfo], capture_output=True, text=True)
        if proc.returncode != 0 or not proc.stdout.strip():
            pytest.skip(f"the local Slurm cluster does not answer: {' '.join(proc.stderr.split())}")
        yield
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


def set_ranks_nice(rank_dirs: list[str], nice: int) -> None:
    """Every thread of the ranks holding ``rank_dirs`` (the pids their owner records name)
    at CPU priority ``nice``. A test that only needs a job's ranks alive (a live job's
    dirs kept) lowers them to 19, so that their training does not compete with the rest
    of the suite for the CPUs, and puts them back at 0 before they must answer a signal
    within the cluster's KillWait."""
    for d in rank_dirs:
        with open(os.path.join(d, "owner.json"), encoding="utf-8") as f:
            pid = json.load(f)["pid"]
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            except ProcessLookupError:
                pass  # a thread that has just ended
