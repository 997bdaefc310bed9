"""``greenroom torchrun``: the chart's launcher, torchrun with the failed worker's exit code
(real torchrun, two real worker processes)."""

import os
import subprocess
import sys


def test_greenroom_torchrun_keeps_the_workers_exit_codes_for_the_failure_policy():
    """The policy reads the trainer container's exit code; greenroom torchrun passes the
    failed worker's on (plain torchrun would exit 1 for a config error and a preemption)."""
    worker = "import os, sys; sys.exit(int(os.environ['CODE']) if os.environ['LOCAL_RANK'] == '1' else 0)"
    for code in (0, 2, 143):
        out = subprocess.run([sys.executable, "-m", "greenroom.cli", "torchrun", "--standalone", "--nproc-per-node=2",
                              "--no-python", sys.executable, "-c", worker], env={**os.environ, "CODE": str(code)},
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == code, out.stderr[-2000:]
