"""Shared fixtures: a scratch dir on a real disk, and skip helpers for optional tools."""

import os
import shutil
import uuid

import pytest

from greenroom import fs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def require_tool(name: str) -> str:
    """Path of a command-line tool, or skip the test saying how it gets installed."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not found: `make test` installs it when run as root on Debian")
    return path
