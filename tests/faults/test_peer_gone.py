"""A rank that ends while its peers wait for it in a collective (a scheduler's SIGTERM that
reaches one rank first, a rank's own error): each peer says so in one line
(``greenroom.ranks.peer_gone``), not with gloo's traceback, and leaves nothing behind.
Two real ``greenroom train`` ranks (gloo, env:// rendezvous, no launcher: torchrun's
agent would race the peer's error with its own SIGTERM)."""

import os
import signal
import socket
import subprocess
import sys
import time

from greenroom.ranks import peer_gone
from tests.cli_support import REPO, greenroom_stopped_at
from tests.train.test_loop import SMALL

GLOO_PEER_GONE = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
    "peer [127.0.0.1]:30602. This is typically caused by a remote worker crashing. Check the logs "
    "of the remote worker."
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_that_ends_at_start_up_leaves_its_peer_one_line_and_no_files(disk_dir):
    root = os.path.join(disk_dir, "offload")
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    args = [
        "train",
        *SMALL,
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--offload-train-disk-dir",
        root,
        "--metrics",
        os.path.join(disk_dir, "m.jsonl"),
    ]
    peer = subprocess.Popen(
        [sys.executable, "-m", "greenroom.cli.main", *args],
        env={**os.environ, **world, "RANK": "1", "LOCAL_RANK": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        # Rank 0 stops before the first collective, after the rendezvous that needs rank 1.
        first = greenroom_stopped_at("parallelize", *args, env={**world, "RANK": "0", "LOCAL_RANK": "0"})
        time.sleep(2)  # rank 1 on into DDP's first collective, where it waits for rank 0
        first.send_signal(signal.SIGTERM)
        first.send_signal(signal.SIGCONT)
        first.communicate(timeout=120)
        assert first.returncode == 143
        _, err = peer.communicate(timeout=120)
    finally:
        peer.kill()
    assert peer.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    (line,) = [line for line in err.splitlines() if line.startswith("greenroom train: error:")]
    assert line.startswith(
        "greenroom train: error: rank 1: a collective with the other ranks failed: another rank went away ("
    ), line
    assert os.listdir(root) == []


def test_only_a_lost_peer_in_a_job_of_several_ranks_is_one_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    line = peer_gone(RuntimeError(GLOO_PEER_GONE))
    assert line == (
        "rank 1: a collective with the other ranks failed: another rank went away (Connection closed "
        "by peer [127.0.0.1]:30602. This is typically caused by a remote worker crashing. Check the "
        "logs of the remote worker.); the launcher's log names the rank that ended first, and that "
        "rank's log says why"
    )
    assert peer_gone(RuntimeError("CUDA error: an illegal memory access was encountered")) is None
    assert peer_gone(ValueError(GLOO_PEER_GONE)) is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert peer_gone(RuntimeError(GLOO_PEER_GONE)) is None  # one rank has no peer: a bug's traceback stays
