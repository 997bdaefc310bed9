"""A lost rank of a 2-node job launched as the chart launches it: one `greenroom torchrun`
per "pod" with the static rendezvous at pod 0 (--master-addr/--master-port, the chart's
--rdzv-conf=timeout), `greenroom train` over gloo with --save/--load/--resume auto. Pod 1's
torchrun is SIGKILLed mid-run (its node lost, its pod deleted). A supervisor stands in for
the Indexed Job's controller: it reruns a pod whose process exited non-zero, at most
backoffLimitPerIndex times per index, as the chart's Job does (its podFailurePolicy counts
these exits). The launcher and trainer processes are the real ones; the pods, the Job
controller and a node's loss are not (no test here runs them on the cluster: the
supervisor keeps only the rule the chart's Job follows, rerun one index on a counted
failure, and SIGKILL of the pod's process tree is what its loss does to the processes).

What must happen: pod 0's rank sees its peer gone and exits 1 at once (not a hang), both
pods are rerun, meet again at the rendezvous, and the job resumes from the last save and
ends at its last iteration, each pod within its rerun limit.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time

from tests.cli_support import REPO

BACKOFF_LIMIT_PER_INDEX = 3  # the chart's default job.backoffLimitPerIndex
RENDEZVOUS_TIMEOUT_S = 60
ITERATIONS = 12
TRAIN = [
    "--prompts",
    "8",
    "--group-size",
    "4",
    "--minibatches",
    "2",
    "--d-model",
    "32",
    "--no-progress",
    "--iterations",
    str(ITERATIONS),
    "--save-interval",
    "1",
]
DEADLINE_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pod_argv(node: int, port: int, save: str, disk: str) -> list[str]:
    greenroom = [sys.executable, "-m", "greenroom.cli.main"]
    return [
        *greenroom,
        "torchrun",
        "--nnodes=2",
        "--nproc-per-node=1",
        f"--node-rank={node}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        f"--rdzv-conf=timeout={RENDEZVOUS_TIMEOUT_S}",
        "--no-python",
        *greenroom,
        "train",
        *TRAIN,
        "--save",
        save,
        "--load",
        save,
        "--resume",
        "auto",
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--offload-train-disk-dir",
        disk,
        "--metrics",
        os.path.join(os.path.dirname(save), f"metrics-{node}.jsonl"),
    ]


class Job:
    """Two pods, each rerun on a non-zero exit, at most BACKOFF_LIMIT_PER_INDEX times."""

    def __init__(self, tmp, port: int, save: str, disk: str):
        self.tmp, self.port, self.save, self.disk = tmp, port, save, disk
        self.procs: dict[int, subprocess.Popen] = {}
        self.failures = {0: [], 1: []}
        self.runs = {0: 0, 1: 0}
        for node in (0, 1):
            self._start(node)

    def _start(self, node: int) -> None:
        self.runs[node] += 1
        log = open(self.tmp / f"pod{node}-run{self.runs[node]}.log", "w")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.procs[node] = subprocess.Popen(
            _pod_argv(node, self.port, self.save, self.disk),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )

    def kill(self, node: int) -> None:
        """SIGKILL the pod's whole process tree, as a lost node or container runtime does
        (torchrun starts its workers in sessions of their own: its group is not enough)."""
        for pid in _tree(self.procs[node].pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def step(self) -> str | None:
        """Rerun what failed; "Complete", "Failed" (a rank out of retries) or None (running)."""
        for node, proc in self.procs.items():
            rc = proc.poll()
            if rc is None or rc == 0:
                continue
            if proc.pid not in [pid for pid, _ in self.failures[node]]:
                self.failures[node].append((proc.pid, rc))
                if len(self.failures[node]) > BACKOFF_LIMIT_PER_INDEX:
                    return "Failed"
                self._start(node)
        return "Complete" if all(p.poll() == 0 for p in self.procs.values()) else None

    def stop(self) -> None:
        for node, proc in self.procs.items():
            if proc.poll() is None:
                self.kill(node)
                proc.wait()

    def log(self, node: int, run: int) -> str:
        return (self.tmp / f"pod{node}-run{run}.log").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')}" for p in sorted(self.tmp.glob("pod*.log")))


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def _iterations(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"iter\s+(\d+)/\d+", text)]


def test_a_lost_rank_fails_its_peer_at_once_and_both_rerun_resume_from_the_last_save(tmp_path, disk_dir):
    save = os.path.join(disk_dir, "ckpt")
    logs = tmp_path / "logs"
    logs.mkdir()
    job = Job(logs, _free_port(), save, os.path.join(disk_dir, "offload"))
    try:
        # Mid-run: once rank 0 has saved at least 3 iterations.
        deadline = time.monotonic() + DEADLINE_S
        while max(_iterations(job.log(0, 1)), default=0) < 3:
            assert job.procs[0].poll() is None and time.monotonic() < deadline, job.logs()
            time.sleep(0.5)
        job.kill(1)
        killed_at = time.monotonic()
        # Pod 0's rank is in a collective with rank 1: it ends at once, saying its peer is gone.
        while job.procs[0].poll() is None:
            assert time.monotonic() - killed_at < RENDEZVOUS_TIMEOUT_S, "pod 0 hangs after its peer was lost"
            time.sleep(0.2)
        first = job.log(0, 1)
        assert job.procs[0].returncode == 1, first
        assert "peer" in first and "Traceback" not in first.split("greenroom torchrun")[0][-2000:], first
        saved = max(_iterations(first))

        state = None
        while state is None:
            assert time.monotonic() < deadline, f"the job neither completed nor failed\n{job.logs()}"
            state = job.step()
            time.sleep(0.5)
        assert state == "Complete", job.logs()
    finally:
        job.stop()
    # Both pods ran again; the last runs resumed after the last save and reached the end.
    last = {node: job.log(node, job.runs[node]) for node in (0, 1)}
    assert all(job.runs[node] >= 2 for node in (0, 1)), job.logs()
    resumed_from = min(_iterations(last[0]))
    assert 1 < resumed_from <= saved + 1, job.logs()
    assert max(_iterations(last[0])) == ITERATIONS, job.logs()
    # Each pod's reruns stayed within the Job's per-index limit.
    assert all(len(f) <= BACKOFF_LIMIT_PER_INDEX for f in job.failures.values()), job.failures
