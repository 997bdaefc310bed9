"""Shared fixtures: a scratch dir on a real disk, processes holding rank dirs, and skip
helpers for optional tools."""

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from greenroom.io import fs, statefile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOLDER = os.path.join(REPO, "tests", "rank_holder.py")


def pytest_collection_modifyitems(config, items):
    """``multigpu`` tests run only where ``-m`` asks for them, and there fail on a machine
    with too few GPUs. Elsewhere each is skipped with the reason in the summary (a skip,
    not a deselection: under xdist the summary does not count deselected tests)."""
    if "multigpu" in (config.getoption("markexpr") or ""):
        return
    elsewhere = pytest.mark.skip(reason="needs a multi-GPU machine: run it there with pytest -m multigpu")
    for item in items:
        if item.get_closest_marker("multigpu") is not None:
            item.add_marker(elsewhere)


@pytest.fixture
def disk_dir(tmp_path):
    """A fresh dir on a disk-backed filesystem (tmp_path, unless /tmp is tmpfs)."""
    if not fs.is_memory_backed(str(tmp_path)):
        yield str(tmp_path)
        return
    path = os.path.join(REPO, ".run", "test-tmp", uuid.uuid4().hex[:12])
    os.makedirs(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def fail_a_write_of(monkeypatch):
    """Make the next write of one file fail with EIO at the syscall wrapper, once."""
    armed = {}
    real = statefile.pwrite_all

    def pwrite_all(fd, buf, offset, path):
        if armed.get("path") == path:
            del armed["path"]
            raise OSError(5, "Input/output error")
        return real(fd, buf, offset, path)

    monkeypatch.setattr(statefile, "pwrite_all", pwrite_all)  # what StateFile.write calls
    return lambda path: armed.update(path=path)


@pytest.fixture
def holders():
    """``start(root, job, rank=0, role="actor", pod_uid=None)``: a real process holding a
    rank dir under ``root`` (tests/rank_holder.py: a RankDir with its flock; as the pod
    ``pod_uid`` where given), and the dir's path. Those still running are killed after
    the test."""
    procs = []

    def start(
        root: str, job: str, rank: int = 0, role: str = "actor", pod_uid: str | None = None
    ) -> tuple[subprocess.Popen, str]:
        env = dict(os.environ, GREENROOM_POD_UID=pod_uid) if pod_uid else None
        p = subprocess.Popen(
            [sys.executable, HOLDER, root, job, role, str(rank)], stdout=subprocess.PIPE, text=True, env=env
        )
        path = p.stdout.readline().strip()
        assert path and os.path.isdir(path), "rank holder did not start"
        procs.append(p)
        return p, path

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def require_tool(name: str) -> str:
    """Path of a command-line tool, or skip the test saying how it gets installed."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not found: `make test` installs it when run as root on Debian")
    return path
