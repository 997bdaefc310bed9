"""A process whose disk wake is cut short while a read is still in flight, then woken
again; used by tests/actor/test_interrupted_waits.py.

    python interrupted_wake_worker.py DIR signal|submit

``signal``: SIGALRM's handler raises while the main thread waits for the wake's reads
(what SIGTERM, made a SystemExit, does under ``scancel``). ``submit``: the wake's second
read fails to submit while the first is in flight. Either way the first read is held at
a gate until well after the wake has raised.

The failed wake gives the actor's storages back (resizes them to zero) only after the
held read has landed: done while it was still to copy into one of them, the worker
thread would write through a null pointer, and this process would die by SIGSEGV. Prints
``identical: True`` when the second wake brings every param back bit for bit.
"""

import signal
import sys
import threading
import time

import numpy as np
import torch

from greenroom import OffloadConfig, actor
from greenroom.io.engine import StateFile, TransferEngine

HOLD_S = 1.0  # how long the first read waits at its gate
INTERRUPT_S = 0.3  # when the wake is interrupted: while that read waits


class Interrupted(BaseException):
    """Not an Exception, as SystemExit (SIGTERM's, in greenroom) is not."""


def hold_first_read() -> threading.Event:
    """Make the next StateFile.read wait for the returned gate (set after HOLD_S)."""
    gate = threading.Event()
    real_read = StateFile.read
    held = []

    def read(self, buf, offset):
        if not held:
            held.append(True)
            gate.wait()
        return real_read(self, buf, offset)

    StateFile.read = read
    threading.Timer(HOLD_S, gate.set).start()
    return gate


def fail_second_submit() -> None:
    real_read = TransferEngine.read
    calls = []

    def read(self, dst, file, offset):
        calls.append(True)
        if len(calls) == 2:
            raise Interrupted("the second read was not submitted")
        return real_read(self, dst, file, offset)

    TransferEngine.read = read


def raise_interrupted(signum, frame):
    raise Interrupted("SIGALRM")


def main() -> int:
    directory, mode = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
    # Of clones: numpy() makes a storage one the offloader must leave resident.
    expected = [p.detach().clone().numpy() for p in model.parameters()]
    config = OffloadConfig(
        offload_train=True, offload_train_target="disk", offload_train_disk_dir=directory, offload_train_disk_chunk_mb=1
    )
    offloader = actor.build_offloader(config, directory, scope="tracked").track(model)
    try:
        offloader.sleep()
        real_state_read, real_engine_read = StateFile.read, TransferEngine.read
        gate = hold_first_read()
        if mode == "signal":
            signal.signal(signal.SIGALRM, raise_interrupted)
            signal.setitimer(signal.ITIMER_REAL, INTERRUPT_S)
        else:
            fail_second_submit()
        try:
            offloader.wake()
            raise AssertionError("the wake was not interrupted")
        except Interrupted:
            pass
        finally:
            StateFile.read, TransferEngine.read = real_state_read, real_engine_read
        print(f"read done when the wake raised: {gate.is_set()}")
        gate.wait()
        time.sleep(0.5)  # the held read's time to land (in freed memory, were the storages given back early)
        assert offloader.is_asleep
        offloader.wake()
        got = [p.detach().numpy() for p in model.parameters()]
        print(f"identical: {all(np.array_equal(a, b) for a, b in zip(expected, got))}")
    finally:
        offloader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
