"""A signal's exception (SIGTERM made a SystemExit, Ctrl-C) that interrupts a wait for
I/O is raised only once no engine thread uses the transfer's memory any more (Note
[interrupted waits] of greenroom.io.engine).

What it guards against: a SIGTERM (``scancel`` under Slurm) landing in the wake's wait,
and the failed wake giving the actor's storages back while a worker thread still copies
a chunk into one of them, so that the rank dies by SIGSEGV instead of SIGTERM and leaves
its rank dir behind.
"""

import os
import signal
import subprocess
import sys
import threading

import pytest
import torch

from greenroom.io.engine import StateFile, TransferEngine

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "actor", "interrupted_wake_worker.py")


class Interrupted(BaseException):
    """Not an Exception, as SystemExit and KeyboardInterrupt are not."""


def hold_reads(monkeypatch) -> threading.Event:
    """From now on StateFile.read waits for the returned gate, which opens in a second."""
    gate = threading.Event()
    real_read = StateFile.read

    def read(self, buf, offset):
        gate.wait()
        return real_read(self, buf, offset)

    monkeypatch.setattr(StateFile, "read", read)
    timer = threading.Timer(1.0, gate.set)
    timer.daemon = True
    timer.start()
    return gate


@pytest.fixture
def alarm():
    """SIGALRM's handler raises Interrupted in the main thread, as SIGTERM's does."""

    def raise_interrupted(signum, frame):
        raise Interrupted("SIGALRM")

    previous = signal.signal(signal.SIGALRM, raise_interrupted)
    yield lambda seconds: signal.setitimer(signal.ITIMER_REAL, seconds)
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("how", ["drain", "wait"])
def test_an_interrupted_wait_raises_once_the_transfer_is_over(disk_dir, monkeypatch, alarm, how):
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    back = torch.zeros_like(src)
    with TransferEngine(1 << 20) as engine, StateFile(os.path.join(disk_dir, "f"), src.numel()) as f:
        engine.write(src, f, 0).wait()
        gate = hold_reads(monkeypatch)
        transfer = engine.read(back, f, 0)
        alarm(0.2)  # while every chunk waits at the gate
        with pytest.raises(Interrupted):
            engine.drain() if how == "drain" else transfer.wait()
        assert gate.is_set() and transfer.done(), "the wait raised with the transfer's chunks still in flight"
    assert torch.equal(back, src)


def test_settle_reports_no_transfer_error_but_raises_a_signal_after_the_same_wait(disk_dir, monkeypatch, alarm):
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    with TransferEngine(1 << 20) as engine, StateFile(os.path.join(disk_dir, "f"), src.numel()) as f:
        engine.write(src, f, 0).wait()
        real_read = StateFile.read

        def failing_read(self, buf, offset):
            raise OSError(5, "Input/output error (injected)")

        monkeypatch.setattr(StateFile, "read", failing_read)
        engine.read(torch.empty_like(src), f, 0)
        engine.settle()  # the caller's own exception is the one to report
        monkeypatch.setattr(StateFile, "read", real_read)
        gate = hold_reads(monkeypatch)
        transfer = engine.read(torch.empty_like(src), f, 0)
        alarm(0.2)
        with pytest.raises(Interrupted):
            engine.settle()
        assert gate.is_set() and transfer.done()


@pytest.mark.parametrize("mode", ["signal", "submit"])
def test_a_wake_cut_short_frees_the_actor_only_after_its_reads_and_wakes_again_bit_identically(disk_dir, mode):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "runtime"), REPO]))
    proc = subprocess.run(
        [sys.executable, WORKER, disk_dir, mode], capture_output=True, text=True, env=env, timeout=300
    )
    # rc -11 (SIGSEGV) would be a worker thread's copy into a freed storage.
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    assert "read done when the wake raised: True" in proc.stdout, proc.stdout
    assert "identical: True" in proc.stdout, proc.stdout
