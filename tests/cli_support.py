"""Run the real ``greenroom`` command in a subprocess, as a user would."""

import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def greenroom(
    *args: str, env: dict | None = None, timeout: float = 300, check_rc: int | None = None, cwd: str | None = None
) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-m", "greenroom.cli.main", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=cwd,
    )
    if check_rc is not None:
        assert proc.returncode == check_rc, f"rc {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def greenroom_stopped_at(
    point: str, *args: str, env: dict | None = None, sigint: bool = False, cwd: str = REPO
) -> subprocess.Popen:
    """``greenroom args`` started with ``GREENROOM_TEST_STOP_AT=point`` (``greenroom.faults``);
    returns once it has stopped itself there, to be resumed with SIGCONT. ``sigint``: start
    it with SIGINT at its default, as from a terminal (``make test`` in the background hands
    its workers SIGINT ignored, and an ignored SIGINT stays ignored in a child)."""
    default_sigint = (lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if sigint else None
    proc = subprocess.Popen(
        [sys.executable, "-m", "greenroom.cli.main", *args],
        env={**os.environ, **(env or {}), "GREENROOM_TEST_STOP_AT": point},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        preexec_fn=default_sigint,
    )
    assert os.WIFSTOPPED(wait_stopped(proc, f"greenroom {args[0]}")), f"greenroom {args[0]} ended before {point}"
    return proc


def wait_stopped(proc: subprocess.Popen, what: str, timeout: float = 120) -> int:
    """The wait status of ``proc`` once it has stopped itself (a kill point) or ended. One
    that does neither in ``timeout`` seconds is killed and the test fails with its signal
    state: a blocking ``waitpid`` hung a full suite for pytest's whole timeout once, when a
    holder sent SIGTERM neither stopped nor exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status = os.waitpid(proc.pid, os.WUNTRACED | os.WNOHANG)
        if pid:
            return status
        time.sleep(0.01)
    try:
        with open(f"/proc/{proc.pid}/status") as f:
            state = "; ".join(line.strip() for line in f if line.startswith(("State", "Sig", "Shd", "Threads")))
    except OSError as e:
        state = str(e)
    proc.kill()
    proc.communicate(timeout=60)
    pytest.fail(f"{what} neither stopped nor ended in {timeout:.0f} s ({state})")


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The error line of a failed command; asserts it is exactly one line and no traceback."""
    assert proc.returncode == 2, f"rc {proc.returncode}: {proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, proc.stderr
    return lines[0]
