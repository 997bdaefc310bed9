"""Run the real ``greenroom`` command in a subprocess, as a user would."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def greenroom(*args: str, env: dict | None = None, timeout: float = 300, check_rc: int | None = None,
              cwd: str | None = None) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-m", "greenroom.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=cwd)
    if check_rc is not None:
        assert proc.returncode == check_rc, f"rc {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def greenroom_stopped_at(point: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    """``greenroom args`` started with ``GREENROOM_TEST_STOP_AT=point`` (``greenroom.faults``);
    returns once it has stopped itself there, to be resumed with SIGCONT."""
    proc = subprocess.Popen([sys.executable, "-m", "greenroom.cli", *args],
                            env={**os.environ, **(env or {}), "GREENROOM_TEST_STOP_AT": point},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), f"greenroom {args[0]} ended before {point}: {status}"
    return proc


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The error line of a failed command; asserts it is exactly one line and no traceback."""
    assert proc.returncode == 2, f"rc {proc.returncode}: {proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, proc.stderr
    return lines[0]
