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
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "greenroom.cli.main",
                "torchrun",
                "--standalone",
                "--nproc-per-node=2",
                "--no-python",
                sys.executable,
                "-c",
                worker,
            ],
            env={**os.environ, "CODE": str(code)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == code, out.stderr[-2000:]


def test_a_signal_to_the_launcher_stops_the_workers_and_exits_128_plus_it():
    """The kubelet's SIGTERM (a pod deleted or drained) goes to the launcher: torchrun's
    agent stops its workers and raised SignalException, which became a traceback and
    exit 1; the chart's policy reads 143 as "preempted, run again"."""
    import signal
    import tempfile
    import time

    worker = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
        "signal.signal(signal.SIGINT, lambda *a: sys.exit(130))\n"
        "open(os.environ['READY'], 'w').close()\n"
        "time.sleep(120)\n"
    )
    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        with tempfile.TemporaryDirectory() as tmp:
            ready = os.path.join(tmp, "ready")
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "greenroom.cli.main",
                    "torchrun",
                    "--standalone",
                    "--nproc-per-node=1",
                    "--no-python",
                    sys.executable,
                    "-c",
                    worker,
                ],
                env={**os.environ, "READY": ready},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            deadline = time.monotonic() + 120
            while not os.path.exists(ready) and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.1)
            assert os.path.exists(ready), proc.communicate(timeout=60)[1][-2000:]
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == code, err[-2000:]
            assert "Traceback" not in err
            assert f"greenroom torchrun: stopped by signal {sig.name}; the workers were stopped too" in err


def test_the_trainers_help_reaches_the_trainer():
    """A --help after the trainer's command is the trainer's, as plain torchrun passes it:
    greenroom's own subcommand parser took it and exited 0 without running anything."""
    worker = "import sys; print('trainer argv', sys.argv[1:])"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "greenroom.cli.main",
            "torchrun",
            "--standalone",
            "--nproc-per-node=1",
            "--no-python",
            sys.executable,
            "-c",
            worker,
            "--epochs",
            "3",
            "--help",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "trainer argv ['--epochs', '3', '--help']" in out.stdout
