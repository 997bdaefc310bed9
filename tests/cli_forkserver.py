"""A Python that has imported torch and ``greenroom train`` once, and forks a fresh
process per ``greenroom`` command it is sent (``tests/cli_support.greenroom_forked``).

Each child is a real process running ``python -m greenroom.cli.main ARGS`` (or a script)
as that command would: its own environment, cwd,
argv, stdin from /dev/null and stdout/stderr in files, and the interpreter's own exit
(atexit handlers, threads joined, streams flushed, an uncaught exception's traceback and
exit code 1, a signal's death). It only skips the imports: about 3 s of CPU per command,
the larger part of a short run's.

Protocol, one JSON line each way per command: the request (module or script, argv, env,
cwd, stdout, stderr, timeout) on stdin; the child's wait status on stdout once it ended, or
``{"timeout": true}`` when it was still running after ``timeout`` seconds (then it is
SIGKILLed and reaped first). Nothing here runs a torch op before a fork: the intra-op
thread pool does not exist yet, so each child starts its own.
"""

import json
import os
import runpy
import signal
import sys
import time

# What a train run imports, torch's lazily imported compiler stack included (the model's
# init runs through torch._dynamo's disable wrapper, which imports it on first call).
PRELOAD = [
    "torch",
    "torch._dynamo",
    "greenroom.cli.main",
    "greenroom.cli.train",
    "matplotlib.pyplot",  # greenroom report's (it picks its backend before the first figure)
]


def child(request: dict) -> None:
    """Become the command: never returns (the command's SystemExit or exception ends
    the interpreter, as at the end of ``python -m``)."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = os.getcwd()  # as under `python -m`: the cwd first
    if "script" in request:  # `python SCRIPT ARGS`: the script's dir first
        script = request["script"]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        sys.argv = [script, *request["argv"]]
        sys.orig_argv = [sys.executable, script, *request["argv"]]
        runpy.run_path(script, run_name="__main__")
        sys.exit(0)
    module = request["module"]
    sys.argv = [module, *request["argv"]]  # runpy puts the module's path first
    sys.orig_argv = [sys.executable, "-m", module, *request["argv"]]  # what a re-exec runs
    # `python -m` runs the module's code as __main__, a copy apart from the imported one.
    sys.modules.pop(module, None)
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    sys.exit(0)


def wait(pid: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"status": status}
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"timeout": True}
        time.sleep(0.01)


def serve() -> None:
    requests, replies = sys.stdin, sys.stdout
    try:
        for name in PRELOAD:
            __import__(name)
    except ImportError as e:  # the client runs its commands as subprocesses then
        replies.write(f"cannot preload: {e}\n")
        return
    replies.write("ready\n")
    replies.flush()
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(request)
        replies.write(json.dumps(wait(pid, request["timeout"])) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve()
