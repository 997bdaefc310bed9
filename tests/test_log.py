"""greenroom's logs: every record carries the rank; the CLI writes one line each with it;
a library user gets no handler from us."""

import logging
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from greenroom.io import fs
from greenroom.log import get_logger

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
log = get_logger("greenroom.test")


def env(**extra):
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "SLURM_PROCID")}
    return {**base, "PYTHONPATH": os.path.join(REPO, "runtime"), **extra}


def one_record(caplog):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="greenroom"):
        log.warning("said")
    [record] = caplog.records
    return record


def test_a_record_carries_the_rank_of_the_launcher_or_the_process_group(caplog, monkeypatch, tmp_path):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    assert one_record(caplog).rank is None
    monkeypatch.setenv("SLURM_PROCID", "5")
    assert one_record(caplog).rank == 5
    monkeypatch.setenv("RANK", "3")  # torchrun's (and our sbatch template's) wins over srun's
    assert one_record(caplog).rank == 3
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        assert one_record(caplog).rank == 0  # the process group is the truth once it exists
    finally:
        dist.destroy_process_group()


def test_a_cli_warning_is_one_line_with_the_rank(tmp_path):
    """A Python warning (a flag that is ignored) through ``greenroom plan`` under torchrun's RANK."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "greenroom.cli.main",
            "plan",
            "--stream-optimizer-state-to-disk",
            "--offload-train-target",
            "cpu",
            "--offload-train-disk-dir",
            str(tmp_path),
            "--params",
            "1e6",
        ],
        env=env(RANK="2"),
        capture_output=True,
        text=True,
        check=True,
    )
    assert proc.stderr.splitlines() == [
        "greenroom[rank 2] WARNING: --offload-train-target is ignored without --offload-train "
        "(streaming alone is the disaggregated case)"
    ]


def test_a_cli_log_record_is_one_line_with_the_rank(tmp_path):
    """A log record (reclaim on a tmpfs) under srun's SLURM_PROCID; without a rank, no prefix."""
    if not os.path.isdir("/dev/shm") or not fs.is_memory_backed("/dev/shm"):
        pytest.skip("/dev/shm is not a tmpfs here")
    root = os.path.join("/dev/shm", f"greenroom-test-log-{os.getpid()}")
    os.makedirs(root)
    try:
        for extra, prefix in (({"SLURM_PROCID": "3"}, "greenroom[rank 3]"), ({}, "greenroom")):
            proc = subprocess.run(
                [sys.executable, "-m", "greenroom.cli.main", "reclaim", root],
                env=env(**extra),
                capture_output=True,
                text=True,
                check=True,
            )
            assert proc.stderr.splitlines() == [f"{prefix} WARNING: {root} is memory-backed (tmpfs); reclaiming anyway"]
    finally:
        os.rmdir(root)


def test_library_use_writes_nothing_unless_the_application_configures_logging():
    code = "from greenroom.log import get_logger; get_logger('greenroom.x').warning('not shown')"
    proc = subprocess.run([sys.executable, "-c", code], env=env(RANK="1"), capture_output=True, text=True, check=True)
    assert proc.stderr == ""
    code = (
        "import logging; logging.basicConfig(format='%(rank)s %(name)s %(message)s'); "
        "from greenroom.log import get_logger; get_logger('greenroom.x').warning('shown')"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env(RANK="1"), capture_output=True, text=True, check=True)
    assert proc.stderr == "1 greenroom.x shown\n"
