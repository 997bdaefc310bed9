"""``--save``'s answer to preemption: SIGTERM (Slurm's preemption signal, forwarded by our
sbatch template) held until the end of an iteration, so a checkpoint is written first,
then the exit SIGTERM would have given (the scheduler requeues, the next run resumes with
``--load``)."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable

import torch.distributed as dist

PREEMPTED_EXIT = 128 + signal.SIGTERM


@contextlib.contextmanager
def preemption_deferred(save, reduce: Callable[[list[float], dist.ReduceOp], list[float]]):
    """With ``save`` (``--save``), SIGTERM is held until the end of the iteration, so a
    checkpoint is written first. Ranks see the signal at different moments, so they agree
    through ``reduce`` (an all-reduce over the ranks) at each boundary; without ``--save``
    SIGTERM keeps its meaning. Yields the check a boundary calls: whether any rank got it."""
    received = []
    if not save or threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return

    def agreed() -> bool:
        [flag] = reduce([float(bool(received))], dist.ReduceOp.MAX)
        return flag > 0

    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        yield agreed
    finally:
        signal.signal(signal.SIGTERM, previous)
    if received:  # arrived during the last iteration: the final save ran, now exit
        raise SystemExit(PREEMPTED_EXIT)
