"""What the FSDP2 torchrun tests share: their launch, and the model each worker builds.

The test files launch themselves under torchrun (gloo, CPU ranks); their ``__main__``
part is the worker, which imports this module (``torchrun`` puts the repo root on the
workers' PYTHONPATH).
"""

import os
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def torchrun(ranks: int, script: str, *args: str) -> None:
    """Run ``script args`` on ``ranks`` CPU ranks; a failed rank fails the test with the
    tails of the output."""
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "runtime") + os.pathsep + REPO, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        os.path.abspath(script),
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, _tails(proc, ranks)


def _tails(proc: subprocess.CompletedProcess, ranks: int) -> str:
    """Each rank's last lines (torchrun prefixes them ``[rankN]:``), then the launcher's:
    the rank that failed first is often not the one whose lines come last."""
    lines = (proc.stdout + proc.stderr).splitlines()
    parts = []
    for rank in range(ranks):
        own = [line for line in lines if line.startswith(f"[rank{rank}]:")]
        parts.append(f"--- rank {rank}, last lines:\n" + "\n".join(own[-30:]))
    rest = [line for line in lines if not line.startswith("[rank")]
    return "\n".join(parts) + "\n--- launcher, last lines:\n" + "\n".join(rest[-40:])


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(33, 64)
        self.b = torch.nn.Linear(64, 17)
        self.row = torch.nn.Parameter(torch.randn(1, 17))  # one row: every rank but the first holds none of it

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) + self.row


def build(mesh) -> Net:
    """The same ``Net`` on every call (seed 0), FSDP2-sharded over ``mesh``."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = Net()
    fully_shard(net.a, mesh=mesh)
    fully_shard(net.b, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net
