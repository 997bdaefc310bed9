"""Run the real ``greenroom`` command in a process of its own, as a user would."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The subcommands that import torch: greenroom() runs them as processes forked from a
# Python that has imported it once (greenroom_forked), the others in a subprocess.
TORCH_COMMANDS = ("train", "plan", "bench", "doctor")


def greenroom(
    *args: str, env: dict | None = None, timeout: float = 300, check_rc: int | None = None, cwd: str | None = None
) -> subprocess.CompletedProcess:
    """``greenroom args`` in a process of its own, to its end (``check_rc``: its exit code
    must be this one)."""
    if args and args[0] in TORCH_COMMANDS:
        proc = greenroom_forked(*args, env=env, timeout=timeout, cwd=cwd)
    else:
        proc = subprocess.run(
            [sys.executable, "-m", "greenroom.cli.main", *args],
            capture_output=True,
            text=True,
            env={**os.environ, **(env or {})},
            timeout=timeout,
            cwd=cwd,
        )
    if check_rc is not None:
        assert proc.returncode == check_rc, f"rc {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


# What a Python reads as it starts (so a forkserver's children share it) or torch as it
# is imported: a command whose environment differs in one of these gets a forkserver of
# its own.
_STARTUP_ENV = ("PYTHON", "OMP_", "MKL_", "LD_", "TORCH", "CUDA", "MALLOC")
_forkservers: dict[tuple, subprocess.Popen | None] = {}
_forkserver_lock = threading.Lock()


def _forkserver(env: dict) -> subprocess.Popen | None:
    """The forkserver for ``env``'s startup variables; None where one cannot start there
    (its imports fail: a test's environment hides torch)."""
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(_STARTUP_ENV)))
    if key in _forkservers and (_forkservers[key] is None or _forkservers[key].poll() is None):
        return _forkservers[key]
    server = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "tests", "cli_forkserver.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    if server.stdout.readline() != "ready\n":
        server.wait()
        server = None
    _forkservers[key] = server
    return server


def greenroom_forked(
    *args: str,
    env: dict | None = None,
    timeout: float = 300,
    cwd: str | None = None,
) -> subprocess.CompletedProcess:
    """``python -m greenroom.cli.main args`` to its end, as a process forked from a Python
    that has already imported torch and ``greenroom train`` (tests/cli_forkserver.py): the
    same command in its own process, environment and cwd, with its own exit, without
    importing torch again (a subprocess where that Python cannot start). For commands
    that run to their end; a test that signals or stops one uses a subprocess."""
    module = "greenroom.cli.main"
    return _forked({"module": module}, [sys.executable, "-m", module], args, env, timeout, cwd)


def python_forked(
    script: str, *args: str, env: dict | None = None, timeout: float = 300, cwd: str | None = None
) -> subprocess.CompletedProcess:
    """``python script args`` to its end, forked as ``greenroom_forked`` forks a command."""
    return _forked({"script": script}, [sys.executable, script], args, env, timeout, cwd)


def _forked(what: dict, command: list, args, env, timeout, cwd) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    argv = [*command, *args]
    with _forkserver_lock:
        server = _forkserver(full_env)
        if server is None:
            return subprocess.run(argv, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=cwd)
        with tempfile.TemporaryDirectory() as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            request = {**what, "argv": list(args), "env": full_env, "cwd": os.path.abspath(cwd or os.getcwd())}
            request.update(stdout=out, stderr=err, timeout=timeout)
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            reply = server.stdout.readline()
            assert reply, "the greenroom forkserver ended"
            reply = json.loads(reply)
            with open(out, encoding="utf-8", errors="replace") as f:
                stdout = f.read()
            with open(err, encoding="utf-8", errors="replace") as f:
                stderr = f.read()
    if reply.get("timeout"):
        raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
    return subprocess.CompletedProcess(argv, os.waitstatus_to_exitcode(reply["status"]), stdout, stderr)


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
