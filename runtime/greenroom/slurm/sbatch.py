"""Talking to Slurm's command-line tools: submit a script, ask for a job's state.

The job state comes from ``scontrol show job``, which needs no accounting database
(submitit's own ``job.state`` reads ``sacct`` and says UNKNOWN on clusters without one).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from greenroom.errors import ConfigError, GreenroomError

TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)


class SlurmError(GreenroomError):
    """A Slurm command refused the request; the message carries its own words."""


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SlurmError(f"{name} not found on PATH: run this on a Slurm login node (or install slurm-client)")
    return path


def _run(argv: list[str], *, stdin: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if proc.returncode != 0:
        message = " ".join((proc.stderr or proc.stdout).split()) or f"exit code {proc.returncode}"
        raise SlurmError(f"{os.path.basename(argv[0])}: {message}")
    return proc


def write_script(path: str, script: str) -> None:
    """Write the script whole or not at all (never a half-written file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(script)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise ConfigError(f"-o {path}: cannot write the script there ({e.strerror})") from None


def submit(script: str) -> str:
    """``sbatch`` the script (from stdin) and return the job id (the script makes its
    own log dir, so a plain ``sbatch`` of a rendered file works the same)."""
    proc = _run([_tool("sbatch"), "--parsable"], stdin=script)
    return proc.stdout.strip().split(";")[0]


def test_only(script: str) -> str:
    """``sbatch --test-only``: Slurm's verdict on the request, without queueing it."""
    proc = _run([_tool("sbatch"), "--test-only"], stdin=script)
    # sbatch prints "sbatch: Job N to start at ... using ... on nodes X" on stderr.
    return " ".join(proc.stderr.split())


def job_info(job_id: str) -> dict[str, str]:
    """``scontrol show job -o`` as a dict (JobState, Restarts, ExitCode, ...)."""
    proc = _run([_tool("scontrol"), "show", "job", "-o", str(job_id)])
    return dict(re.findall(r"(\w+)=(\S*)", proc.stdout))


def job_state(job_id: str) -> str:
    return job_info(job_id).get("JobState", "UNKNOWN")


def cancel(job_id: str, *, signal: str | None = None, batch: bool = False, full: bool = False) -> None:
    """``scancel``; with ``signal``, only signal: the steps, or the batch shell
    (``batch``), or both (``full``)."""
    argv = [_tool("scancel")]
    if signal:
        argv.append(f"--signal={signal}")
    if batch:
        argv.append("--batch")
    if full:
        argv.append("--full")
    _run([*argv, str(job_id)])
