"""A run's checkpoints: the load from ``--load``, each save into ``--save`` (between steps,
or staged before the iteration's last step and published after it, on a thread under
``--async-save``), and each save's background read-back until it is promoted or dropped."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from greenroom.config import OffloadConfig
from greenroom.dirs.signals import signals_held
from greenroom.errors import CheckpointError, one_line
from greenroom.io import publish
from greenroom.log import get_logger
from greenroom.tensors import local_tensor
from greenroom.train import checkpoint, rotation
from greenroom.train.config import TrainConfig

log = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class SaveSettings:
    """What the checkpoints of a run depend on, taken once from its configurations."""

    save: str | None
    load: str | None
    keep_last: int
    async_save: bool
    lr: float
    weight_decay: float
    streaming: bool
    """The optimizer streams its state (``--stream-optimizer-state-to-disk``)."""
    no_load_optim: bool

    @classmethod
    def of(cls, config: TrainConfig, offload: OffloadConfig) -> SaveSettings:
        return cls(
            save=config.save,
            load=config.load,
            keep_last=config.keep_last,
            async_save=config.async_save,
            lr=config.lr,
            weight_decay=config.weight_decay,
            streaming=offload.stream_optimizer_state_to_disk,
            no_load_optim=offload.no_load_optim,
        )


def saved_bucket_numel(settings: SaveSettings, rank: int) -> int | None:
    """The bucket size a streamed state is loaded with: that of ``--load``'s newest
    checkpoint that records one for ``rank``; None without one to load."""
    if not settings.load or settings.no_load_optim:
        return None
    try:
        found = rotation.candidates(settings.load)
    except CheckpointError:
        return None  # the load says what is wrong
    return next((n for n in (checkpoint.saved_bucket_numel(p, rank) for p in found) if n is not None), None)


class Checkpointer:
    """The checkpoints of one rank's run. The trainer owns it and gives it its collectives
    (``barrier``, ``reduce``: an all-reduce of a few floats) and its rank 0 output line
    (``say``)."""

    def __init__(
        self,
        settings: SaveSettings,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        rank: int,
        world_size: int,
        barrier: Callable[[], None],
        reduce: Callable[[Sequence[float], dist.ReduceOp], list[float]],
        say: Callable[[str], None],
    ) -> None:
        self.settings = settings
        self.model, self.optimizer = model, optimizer
        self.rank, self.world_size = rank, world_size
        self._barrier, self._reduce, self._say = barrier, reduce, say
        self._save_thread: threading.Thread | None = None  # an --async-save publish in flight
        self._save_error: BaseException | None = None
        self._saved_iteration = 0
        # The last save's iteration and its background read (rotation Note [a checkpoint
        # is verified before it counts]), until ``promote`` settles it.
        self._unverified: tuple[int, rotation.Verification] | None = None

    def load(self) -> int:
        """Load ``--load``'s newest good checkpoint; return its iteration."""
        s = self.settings
        # Under the checkpoint's lock (rank 0's) until every rank has read it: no save
        # swaps it meanwhile (``publish`` Note [one writer per checkpoint dir]).
        lock = rotation.lock_path(s.load)
        with publish.locked(lock, reading=True) if self.rank == 0 else contextlib.nullcontext():
            if self.rank == 0:
                checkpoint.settle(s.load)
            self._barrier()
            try:
                start = self._load_newest_good(dropping=lock == s.save)
            finally:
                self._barrier()
        checkpoint.apply_run_hyperparameters(self.optimizer, s.load, lr=s.lr, weight_decay=s.weight_decay)
        return start

    def _load_newest_good(self, *, dropping: bool) -> int:
        """Load the first of ``--load``'s checkpoints (``rotation.candidates``) that every
        rank verifies; one damaged is skipped with one line (and dropped where this run
        saves there, holding the root's lock), the last one's error raised."""
        s = self.settings
        kwargs = dict(
            model=self.model,
            optimizer=self.optimizer,
            streaming=s.streaming,
            no_load_optim=s.no_load_optim,
            rank=self.rank,
            world_size=self.world_size,
        )
        candidates = rotation.candidates(s.load)
        for k, path in enumerate(candidates):
            error = None
            try:
                meta = checkpoint.verify_for(path, **kwargs)
            except CheckpointError as e:
                error = e
            [good] = self._reduce([0.0 if error else 1.0], dist.ReduceOp.MIN)
            if good:
                return checkpoint.load(path, meta=meta, **kwargs)
            last = k + 1 == len(candidates)
            if last:
                raise error or CheckpointError(
                    f"--load {s.load}: another rank found {path} damaged (its line says "
                    "why), and no older checkpoint is there"
                )
            if error is not None:
                log.warning(f"--load {s.load}: {os.path.basename(path)} is damaged, skipped: {one_line(error)}")
            if self.rank == 0:
                if dropping:
                    publish.discard(path)
                log.warning(
                    f"--load {s.load}: {'dropped' if dropping else 'skipped'} {os.path.basename(path)}, "
                    f"loading the newest good one before it, {os.path.basename(candidates[k + 1])}"
                )
        raise AssertionError("unreachable: the last candidate returns or raises")

    def bytes_per_rank(self) -> int:
        """What this rank's part of a ``--save`` takes: its weights plus the optimizer
        state (the streamed files, or AdamW's two moments of every param)."""
        weights = sum(local_tensor(t).numel() * t.element_size() for t in self.model.state_dict().values())
        store = getattr(self.optimizer, "store", None)
        return weights + (store.state_bytes if store is not None else 2 * weights)

    def save(self, iteration: int) -> None:
        """A save between steps (preemption, or a run with nothing left to train)."""
        self.join()
        self.promote()
        self._check_room()
        path = rotation.iteration_dir(self.settings.save, iteration)
        # Replacing that iteration's dir (a resume with nothing left to train) discards the
        # one there at the publish: so what it links is read back before, not after.
        replacing = os.path.isdir(path)
        checkpoint.save(
            path,
            model=self.model,
            optimizer=self.optimizer,
            streaming=self.settings.streaming,
            iteration=iteration,
            rank=self.rank,
            world_size=self.world_size,
            barrier=self._barrier,
            verify=replacing,
        )
        self._say(f"saved iteration {iteration} to {path}")
        self._verify_in_background(iteration, linked=not replacing)

    def _check_room(self) -> None:
        """Rank 0, before a save stages: room for this checkpoint beside the kept ones."""
        if self.rank == 0:
            rotation.check_room(self.settings.save, self.bytes_per_rank() * self.world_size)

    def _verify_in_background(self, iteration: int, *, linked: bool) -> None:
        """Start reading back what the save of ``iteration`` linked (rotation Note [a
        checkpoint is verified before it counts]); ``linked`` False: nothing to read."""
        work = None
        if linked and self.settings.streaming:
            optim_dir = os.path.join(
                checkpoint.rank_path(rotation.iteration_dir(self.settings.save, iteration), self.rank), "optim"
            )
            work = lambda: self.optimizer.verify_linked(optim_dir)  # noqa: E731
        self._unverified = (iteration, rotation.Verification(work))

    def promote(self, *, final: bool = False) -> None:
        """Settle the last save's verification on every rank: passed everywhere, rank 0
        points the root at it and removes what ``--keep-last`` no longer keeps; failed
        anywhere, it is dropped with one line (and a run's last save failing ends it with
        an error, since the checkpoint it reported is gone)."""
        if self._unverified is None:
            return
        save = self.settings.save
        (iteration, verification), self._unverified = self._unverified, None
        why = verification.wait()
        if why is not None:
            log.warning(f"--save {save}: iteration {iteration} failed its verification: {why}")
        [good] = self._reduce([0.0 if why else 1.0], dist.ReduceOp.MIN)
        if self.rank == 0:
            if good:
                rotation.promote(save, iteration, self.settings.keep_last)
            else:
                rotation.drop(save, iteration, "its bytes did not verify (see the line above)")
        self._barrier()
        if not good and final:
            left = rotation.iterations(save)
            raise CheckpointError(
                f"--save {save}: the checkpoint of iteration {iteration} failed its "
                "verification and was dropped; "
                + (f"resume from iteration {left[0]} (--load {save})" if left else "no checkpoint is left there")
            )

    def begin(self, iteration: int) -> None:
        """Before the last optimizer step of the iteration that ends at ``iteration``:
        stage its save, and have a streaming optimizer write its state into it from that
        step's own pass."""
        self.join()  # the previous save is published before this one stages
        self.promote()  # and verified (read back beside this iteration), so retention frees its room first
        self._check_room()
        path = rotation.iteration_dir(self.settings.save, iteration)
        mine = checkpoint.begin(path, rank=self.rank, barrier=self._barrier)
        if self.settings.streaming:
            self.optimizer.checkpoint_next_step(os.path.join(mine, "optim"))

    def finish(self, iteration: int) -> None:
        """After the step: the weights, manifests, meta and the publish; with
        ``--async-save`` on a thread, from host copies taken now."""
        s = self.settings
        path = rotation.iteration_dir(s.save, iteration)
        # Written twice from the step's buffers (no links) or by a resident optimizer: nothing shared to read back.
        linked = s.streaming and getattr(self.optimizer.last_checkpoint, "mode", "link") == "link"
        kwargs = dict(
            model_state=checkpoint.model_state(self.model),
            model_config=checkpoint.model_config(self.model),
            optimizer=self.optimizer,
            # A resident optimizer's state, copied only for a publish beside the next step.
            optim_state=checkpoint.optimizer_state(self.optimizer) if s.async_save and not s.streaming else None,
            streaming=s.streaming,
            optim_written=s.streaming,
            iteration=iteration,
            rank=self.rank,
            world_size=self.world_size,
        )
        if not s.async_save:
            checkpoint.finish(path, barrier=self._barrier, **kwargs)
            self._say(f"saved iteration {iteration} to {path}")
            self._verify_in_background(iteration, linked=linked)
            return

        def publish() -> None:
            try:
                checkpoint.finish(path, **kwargs)
            except BaseException as e:  # raised by the next join, on the main thread
                self._save_error = e
                return
            self._verify_in_background(iteration, linked=linked)

        self._save_error = None
        # A daemon: a publish that a second signal gave up on (``wait_for_publish``) must not
        # keep the process from exiting; every other way out joins it first.
        self._save_thread = threading.Thread(target=publish, name="greenroom-async-save", daemon=True)
        self._save_thread.start()
        self._saved_iteration = iteration

    def join(self) -> None:
        """Wait for an ``--async-save`` publish in flight; raise what it raised."""
        if self._save_thread is None:
            return
        self.wait_for_publish()
        self._save_thread = None
        if self._save_error is not None:
            raise self._save_error
        self._say(
            f"saved iteration {self._saved_iteration} to "
            f"{rotation.iteration_dir(self.settings.save, self._saved_iteration)} (published in the background)"
        )

    def wait_for_publish(self) -> None:
        """Until an ``--async-save`` publish in flight ends (it finishes or fails), or a
        second SIGTERM or SIGINT comes; at once when none is in flight. One such signal
        meanwhile has its effect then (Note [an interrupted close] of
        greenroom.dirs.rankdir). Raised in the join, its exception would make Python 3.11's
        ``Thread.join`` take the thread, still writing the checkpoint, for stopped: no later
        join would wait for it, so the close would go on to close the files under it and the
        process would exit mid-publish; raised in the close's own join, it would also leave
        the close's cleanups to atexit and the garbage collector.

        A second signal is the way out of a publish that never ends (rank 0's waits
        without a deadline for the manifest of a rank killed mid-save): both then have
        their effect at once, the close runs under the publish, which is given up (a
        daemon thread, it dies with the process), and the staged ``DIR.new`` stays for the
        next run's settle to discard, as after a forced exit. Signals whose handlers do
        not raise (SIGTERM in the loop, recorded for the preemption save; an ignored one)
        leave the wait going on."""
        thread = self._save_thread
        if thread is None:
            return
        try:
            while thread.is_alive():
                with signals_held() as received:
                    while thread.is_alive() and len(received) < 2:
                        thread.join(1.0)  # its end ends this at once; a second signal, within a second
        finally:
            if thread.is_alive():  # given up: the close must not wait for it again
                self._save_thread = None
