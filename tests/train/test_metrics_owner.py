"""One writer per ``greenroom train`` metrics file (``greenroom.train.preflight`` Note
[one writer per metrics file]): real processes started from one dir at once.

Two runs writing one file would interleave their records, or the second truncate the
first's, without a word: the second is refused. A run is stopped at a kill point
(``sync@2``: iteration 1's record written, iteration 2 begun) while a second one
starts; then it is let go.
"""

import json
import os
import re
import signal
import subprocess

import pytest

from tests.cli_support import greenroom_forked, greenroom_stopped_at, one_line_error

SMALL = ["--prompts", "8", "--group-size", "4", "--minibatches", "2", "--d-model", "32", "--no-progress"]


@pytest.fixture(autouse=True)
def outside_a_scheduler(monkeypatch):
    """Runs outside any scheduler (the default file is then the plain one), one thread each."""
    for var in ("GREENROOM_JOB_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def train(*args, cwd, env=None):
    """A run to its end, in a process forked from a Python that has imported torch already."""
    return greenroom_forked("train", *SMALL, *args, cwd=cwd, env=env)


def stopped(*args, cwd, env=None):
    """A run stopped in iteration 2, its first record written."""
    return greenroom_stopped_at("sync@2", "train", *SMALL, *args, cwd=cwd, env=env)


def resume(proc) -> subprocess.CompletedProcess:
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def iterations(path) -> list[int]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["iteration"] for line in f]


def test_a_second_run_given_the_same_metrics_is_refused_and_the_first_keeps_its_file(disk_dir):
    metrics = os.path.join(disk_dir, "m.jsonl")
    first = stopped("--iterations", "3", "--metrics", metrics, cwd=disk_dir)
    try:
        second = train("--iterations", "2", "--metrics", metrics, cwd=disk_dir)
        line = one_line_error(second)
        assert re.search(
            rf"--metrics {re.escape(metrics)}: another run \(pid {first.pid} on \S+\) is writing it", line
        ), line
        assert "iter" not in second.stdout, "refused before training"
        assert iterations(metrics) == [1], "the first run's record is untouched"
    finally:
        done = resume(first)
    assert done.returncode == 0, done.stderr[-3000:]
    assert iterations(metrics) == [1, 2, 3]
    assert sorted(os.listdir(disk_dir)) == ["m.jsonl"], "the lock file goes with its run"


def test_two_runs_with_the_default_metrics_both_finish_with_their_own_complete_files(disk_dir):
    first = stopped("--iterations", "3", cwd=disk_dir)
    try:
        second = train("--iterations", "2", cwd=disk_dir)
    finally:
        done = resume(first)
    assert second.returncode == 0, second.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]
    assert iterations(os.path.join(disk_dir, ".run", "train-metrics.jsonl")) == [1, 2, 3], "the first run's, whole"
    [moved] = [name for name in os.listdir(os.path.join(disk_dir, ".run")) if name != "train-metrics.jsonl"]
    assert re.fullmatch(r"train-metrics-pid\d+\.jsonl", moved), moved
    own = os.path.join(".run", moved)
    assert f".run/train-metrics.jsonl is being written by another run (pid {first.pid} on " in second.stderr, (
        second.stderr
    )
    assert f"plot with: greenroom report {own}" in second.stdout, second.stdout
    assert iterations(os.path.join(disk_dir, own)) == [1, 2]


def test_the_default_metrics_is_per_job_under_a_scheduler(disk_dir):
    """Two Slurm jobs submitted from one dir; a requeued job keeps its id, so it resumes
    into its own file, never into the other job's."""
    first = stopped("--iterations", "3", cwd=disk_dir, env={"SLURM_JOB_ID": "101"})
    try:
        second = train("--iterations", "2", cwd=disk_dir, env={"SLURM_JOB_ID": "102"})
    finally:
        done = resume(first)
    assert second.returncode == 0 and done.returncode == 0, second.stderr[-2000:] + done.stderr[-2000:]
    assert "another run" not in second.stderr
    assert sorted(os.listdir(os.path.join(disk_dir, ".run"))) == ["train-metrics-101.jsonl", "train-metrics-102.jsonl"]
    assert iterations(os.path.join(disk_dir, ".run", "train-metrics-101.jsonl")) == [1, 2, 3]
    assert iterations(os.path.join(disk_dir, ".run", "train-metrics-102.jsonl")) == [1, 2]


def test_a_lock_left_by_a_killed_run_does_not_block_the_next(disk_dir):
    metrics = os.path.join(disk_dir, "m.jsonl")
    for args, path in ((["--metrics", metrics], metrics), ([], os.path.join(disk_dir, ".run", "train-metrics.jsonl"))):
        killed = train("--iterations", "3", *args, cwd=disk_dir, env={"GREENROOM_TEST_KILL_AT": "sync@2"})
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        assert os.path.exists(path + ".lock"), "the killed run left its lock file (its flock went with it)"
        again = train("--iterations", "2", *args, cwd=disk_dir)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "another run" not in again.stderr, "not moved aside by a dead run's lock file"
        assert iterations(path) == [1, 2]
        assert not os.path.exists(path + ".lock")
