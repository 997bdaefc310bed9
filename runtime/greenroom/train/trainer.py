"""The colocated train/sleep/rollout/wake loop behind ``greenroom train``."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import shlex
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from greenroom import actor
from greenroom.actor.memory import RssSampler, device_used_bytes
from greenroom.config import OffloadConfig
from greenroom.devices import resolve_codec, resolve_device
from greenroom.dirs.rankdir import RankDir
from greenroom.errors import ConfigError
from greenroom.faults import kill_point
from greenroom.io import publish
from greenroom.io.fs import stored_bytes
from greenroom.ranks import launcher_number
from greenroom.train import preflight, summary
from greenroom.train.config import TrainConfig
from greenroom.train.distributed import RankGroup, parallelize
from greenroom.train.loss import policy_loss
from greenroom.train.model import ModelConfig, Transformer, set_precision
from greenroom.train.optimizer import build_optimizer, stream_counters
from greenroom.train.preemption import PREEMPTED_EXIT, preemption_deferred
from greenroom.train.rollout import RolloutEngine
from greenroom.train.saving import Checkpointer, SaveSettings
from greenroom.train.task import TaskConfig, reward, sample_prompts
from greenroom.units import GB, size_text


class Trainer:
    """One rank of the job. Use as a context manager: ``__exit__`` closes the
    offloader, the optimizer's files and the per-rank dir, whatever happened."""

    def __init__(
        self, config: TrainConfig, *, offload: OffloadConfig, model: ModelConfig, task: TaskConfig, rank: int = 0
    ) -> None:
        # A symlinked --save/--load is resolved once: a killed save is left beside the
        # target, and every step (settling it, the lock, the swap) must look there.
        config = dataclasses.replace(
            config,
            **{name: os.path.realpath(getattr(config, name)) for name in ("save", "load") if getattr(config, name)},
        )
        self.config, self.offload, self.model_config, self.task = config, offload, model, task
        self.rank = rank
        self.world_size = launcher_number("WORLD_SIZE", 1, minimum=1)
        self.device = self._resolve_device()
        self.ranks = RankGroup(self.world_size, self.device)
        self._stack = contextlib.ExitStack()
        self.rank_dir: RankDir | None = None
        self.save_settings = SaveSettings.of(config, offload)
        self.checkpoints: Checkpointer | None = None  # once the model and optimizer are built

    def _resolve_device(self) -> torch.device:
        if resolve_device(self.config.device) == "cuda":
            return torch.device("cuda", launcher_number("LOCAL_RANK", 0))
        return torch.device("cpu")

    # -- setup and teardown ---------------------------------------------------------
    def __enter__(self) -> "Trainer":
        try:
            self._open()
        except BaseException as e:
            self._close(e)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._close(exc)

    def _close(self, exc: BaseException | None) -> None:
        """Run the cleanups. The exception that ended the run is what the user sees: a
        cleanup error is added to it as a note, never put in its place."""
        try:
            try:
                if self.checkpoints is not None:
                    self.checkpoints.wait_for_publish()  # before the files a publish writes close
            finally:  # also after a signal that the wait held, raised at its end
                self._stack.close()
        except BaseException as cleanup:
            if exc is None:
                raise
            exc.add_note(f"then, while cleaning up: {type(cleanup).__name__}: {cleanup}")

    def _open(self) -> None:
        c, offload = self.config, self.offload
        if self.rank == 0:
            preflight.check_paths(c)
            if c.save:  # held for the run: a second trainer saving here is refused now, not at its end
                self._stack.enter_context(publish.locked(c.save))
        if self.device.type == "cuda" and offload.offload_train and c.offload_backend != "portable":
            # Before any CUDA allocation: torch_memory_saver's hook must be preloaded.
            actor.relaunch_with(actor.launch_env(offload, self.rank, role=c.role, mover=c.offload_mover))
            torch.cuda.set_device(self.device)
        preflight.check_fits(c, self.model_config, self.device)
        if self.world_size > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
            self._stack.callback(dist.destroy_process_group)
        if offload.uses_disk:
            self.rank_dir = RankDir(
                offload.offload_train_disk_dir, role=c.role, rank=self.rank, allow_tmpfs=offload.allow_tmpfs
            ).open()
            self._stack.callback(self.rank_dir.close)
        self.memory = RssSampler()
        self._stack.callback(self.memory.close)
        # Once, after CUDA is set up: the offloader and the optimizer write with this codec
        # and the header names it.
        self.compression = resolve_codec(offload, self.device)
        self.offloader = actor.build_offloader(
            offload,
            self.rank_dir,
            device=self.device,
            backend=c.offload_backend,
            mover=c.offload_mover,
            compression=self.compression,
        )
        self._stack.callback(self.offloader.close)
        torch.manual_seed(c.seed)
        with self.device:  # built in place: a multi-billion model never exists on the host
            self.model = set_precision(Transformer(self.model_config), c.dtype)
            with self.offloader.rollout_region():
                self.engine = RolloutEngine(self.model_config, device=self.device, precision=c.dtype)
        # Frozen: never tracked, never stepped; complete offload finds it, and clean-skip
        # writes it once.
        self.reference = copy.deepcopy(self.model).requires_grad_(False) if c.reference_policy else None
        self.policy = parallelize(self.model, parallel=c.parallel, world_size=self.world_size, device=self.device)
        self.optimizer = self._build_optimizer()
        self.offloader.track(self.model, self.optimizer)
        self.checkpoints = Checkpointer(
            self.save_settings,
            model=self.model,
            optimizer=self.optimizer,
            rank=self.rank,
            world_size=self.world_size,
            barrier=self.ranks.barrier,
            reduce=self.ranks.reduce,
            say=self._say,
        )
        # Loaded before the metrics file is opened: a refused checkpoint leaves no file behind.
        self.start_iteration = self.checkpoints.load() if c.load else 0
        if self.start_iteration > c.iterations:
            raise ConfigError(
                f"--iterations {c.iterations} is below the iteration of --load {c.load} "
                f"({self.start_iteration}): a resumed run trains up to --iterations in all, so "
                f"give --iterations {self.start_iteration} or more"
            )
        if self.rank == 0 and c.save:
            preflight.check_save_space(c.save, self.checkpoints.bytes_per_rank() * self.world_size)
        # The offload file made and written once for the actor as it stands (a loaded
        # optimizer's state included), before the first sleep and before the metrics file:
        # no room is refused here and leaves nothing behind (Offloader.prepare).
        self.offloader.prepare()
        self.metrics_path, self.metrics_file = None, None
        if self.rank == 0 and c.metrics != "":
            self.metrics_path, self.metrics_file = self._stack.enter_context(
                preflight.open_metrics(c.metrics, append=bool(c.load), resume_at=self.start_iteration)
            )
        self.start_time = time.perf_counter()

    def _build_optimizer(self) -> torch.optim.Optimizer:
        optimizer = build_optimizer(
            list(self.model.parameters()),
            self.config,
            self.offload,
            self.rank_dir,
            save_settings=self.save_settings,
            rank=self.rank,
            compression=self.compression,
            device=self.device,
        )
        if self.offload.stream_optimizer_state_to_disk and hasattr(optimizer, "close"):
            self._stack.callback(self._close_optimizer, optimizer)
        return optimizer

    # -- the loop -------------------------------------------------------------------
    def train(self) -> None:
        c = self.config
        start = self.start_iteration
        self._say(self._header(start))
        with preemption_deferred(c.save, self.ranks.reduce) as preempted:
            for it in range(start, c.iterations):
                saves = self._saves_after(it + 1)
                self._log(self.iteration(it, save=saves))
                if saves:
                    self.checkpoints.finish(it + 1)
                if preempted() and it + 1 < c.iterations:
                    # Save where every rank agrees to stop, then exit as SIGTERM would:
                    # the scheduler requeues and the next run resumes with --load.
                    if not saves:
                        self.checkpoints.save(it + 1)
                    self.checkpoints.join()
                    self.checkpoints.promote(final=True)
                    self._say(f"preempted: saved iteration {it + 1}, exiting")
                    raise SystemExit(PREEMPTED_EXIT)
            if c.save and start >= c.iterations:
                self.checkpoints.save(c.iterations)  # nothing left to train: the checkpoint as loaded
            self.checkpoints.join()
            self.checkpoints.promote(final=True)
        if self.metrics_file is not None:
            path = self.metrics_path
            self._say(f"metrics: {os.path.abspath(path)} (plot with: greenroom report {shlex.quote(path)})")

    def _saves_after(self, iteration: int) -> bool:
        """Whether ``--save`` writes a checkpoint at the end of ``iteration``."""
        c = self.config
        return bool(c.save) and (
            iteration == c.iterations or bool(c.save_interval) and iteration % c.save_interval == 0
        )

    def iteration(self, it: int, *, save: bool = False) -> dict:
        c = self.config
        gen = torch.Generator().manual_seed(c.seed * 1_000_003 + self.rank * 7_919 + it)
        events: list[dict] = []
        self.memory.reset_peak()
        peaks = {"device": 0}

        def mark(phase: str, began: float) -> None:
            used = device_used_bytes(self.device)
            resident = self.offloader.resident_bytes()
            peaks["device"] = max(peaks["device"], used if used is not None else resident)
            events.append(
                {
                    "phase": phase,
                    "start": began - self.start_time,
                    "end": time.perf_counter() - self.start_time,
                    "host_rss": self.memory.rss(),
                    "device_used": used,
                    "actor_resident": resident,
                }
            )

        # The streamed state's bytes over the whole iteration: the sleep writes back the
        # bucket the previous step kept on the device (optim.store.held Note [the last
        # bucket stays]), the steps read and write the rest.
        stream_start = stream_counters(self.optimizer)
        t = time.perf_counter()
        kill_point("sync")
        self.engine.sync_from(self.model)
        mark("sync", t)
        t = time.perf_counter()
        before_sleep = stream_counters(self.optimizer)
        with self._bar(1, "sleep") as bar:
            kill_point("sleep")
            slept = self.offloader.sleep()
            bar.update()
        mark("sleep", t)
        sleep_written = stream_counters(self.optimizer)["stream_written_bytes"] - before_sleep["stream_written_bytes"]
        t = time.perf_counter()
        with self.offloader.rollout_region(), self._bar(self.task.digits, "rollout") as bar:
            prompts = sample_prompts(self.task, c.prompts, gen).repeat_interleave(c.group_size, dim=0)
            kill_point("rollout")
            completions, old_logp = self.engine.generate(prompts, self.task.digits, gen, on_token=bar.update)
            rewards = reward(prompts, completions)
            mark("rollout", t)
        t = time.perf_counter()
        with self._bar(1, "wake") as bar:
            kill_point("wake")
            woke = self.offloader.wake()
            bar.update()
        mark("wake", t)
        t = time.perf_counter()
        streamed_before = stream_counters(self.optimizer)
        loss_sum, step_s = self._train_step(
            prompts, completions, old_logp, rewards, gen, save_at=it + 1 if save else None
        )
        mark("train", t)
        stream_end = stream_counters(self.optimizer)
        stepped = {k: stream_end[k] - streamed_before[k] for k in stream_end}
        streamed = {k: stream_end[k] - stream_start[k] for k in stream_end}
        reward_mean, loss_mean = self.ranks.mean(rewards.mean().item(), loss_sum / c.minibatches)
        phase = {e["phase"]: e["end"] - e["start"] for e in events}
        return {
            "iteration": it + 1,
            "iterations": c.iterations,
            "reward": reward_mean,
            "loss": loss_mean,
            "train_s": phase["train"],
            "rollout_s": phase["rollout"],
            "sync_s": phase["sync"],
            "sleep_s": slept.seconds,
            "sleep_bytes": slept.nbytes,
            "sleep_gbps": slept.bytes_per_s / GB,
            "sleep_written": slept.copied,
            "sleep_clean": slept.clean,
            "sleep_dead": slept.dead,
            "wake_s": woke.seconds,
            "wake_bytes": woke.nbytes,
            "wake_gbps": woke.bytes_per_s / GB,
            "offloaded_bytes": slept.nbytes,
            **streamed,
            "stream_s": step_s,
            # Of stream_written_bytes, what this iteration's sleep wrote back: the bucket the
            # previous iteration's last step kept on the device.
            "stream_sleep_written_bytes": sleep_written,
            # The bucket this iteration's last step left on the device: read this iteration,
            # written back at the next sleep (or save, or exit).
            "stream_kept_bytes": getattr(getattr(self.optimizer, "store", None), "kept_bytes", 0),
            # The steps' own bytes over the steps' seconds (the sleep's write-back is timed in sleep_s).
            "stream_gbps": (stepped["stream_read_bytes"] + stepped["stream_written_bytes"]) / step_s / GB
            if step_s and stepped["stream_read_bytes"]
            else 0.0,
            "disk_stored_bytes": stored_bytes(self.rank_dir.path) if self.rank_dir is not None else 0,
            "kv_cache_bytes": self.engine.last_cache_bytes,
            "peak_device_bytes": peaks["device"],
            "peak_host_rss": self.memory.peak,
            "device": str(self.device),
            "world_size": self.world_size,
            "backend": self.offloader.backend,
            "events": events,
        }

    def _train_step(
        self, prompts, completions, old_logp, rewards, gen, *, save_at: int | None = None
    ) -> tuple[float, float]:
        """The iteration's optimizer steps; ``save_at``: the iteration whose save the last
        step writes its state into."""
        c = self.config
        grouped = rewards.view(c.prompts, c.group_size)
        advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
        order = torch.randperm(prompts.shape[0], generator=gen)
        size = prompts.shape[0] // c.minibatches
        loss_sum, step_s = 0.0, 0.0
        bar = self._bar(c.minibatches, "train")
        for i in range(c.minibatches):
            idx = order[i * size : (i + 1) * size]
            # Zeroed in place, not dropped: the grads stay part of what the actor holds.
            self.optimizer.zero_grad(set_to_none=False)
            loss = policy_loss(
                self.policy,
                prompts[idx],
                completions[idx],
                old_logp[idx].to(self.device),
                advantages[idx].to(self.device),
                c.clip,
                reference=self.reference,
                kl_coef=c.kl_coef,
            )
            loss.backward()
            if save_at is not None and i == c.minibatches - 1:
                self.checkpoints.begin(save_at)
            began = time.perf_counter()
            self.optimizer.step()
            step_s += time.perf_counter() - began
            kill_point("train-step")  # between two optimizer steps: the state files are mid-iteration
            loss_sum += loss.item()
            bar.update()
        bar.close()
        return loss_sum, step_s

    # -- reporting ------------------------------------------------------------------
    def _bar(self, total: int, desc: str):
        # Bars only on a terminal: piped to a file (CI, kubectl logs, a Slurm .out) they
        # would bury the one summary line per iteration.
        return tqdm(
            total=total,
            desc=f"  {desc}",
            leave=False,
            dynamic_ncols=True,
            disable=not self.config.progress or self.rank != 0 or not sys.stderr.isatty(),
            file=sys.stderr,
        )

    def _header(self, start: int) -> str:
        return summary.header(
            self.offload,
            params=self.model_config.num_params(),
            dtype=self.config.dtype,
            device=self.device,
            world_size=self.world_size,
            backend=self.offloader.backend,
            optimizer=self.optimizer,
            start=start,
            rank_dir_path=self.rank_dir.path if self.rank_dir is not None else None,
            compression=self.compression,
        )

    def _log(self, record: dict) -> None:
        if self.rank != 0:
            return
        line = summary.iteration_line(record, on_disk=self.rank_dir is not None)
        self._say(line)
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()

    def _close_optimizer(self, optimizer) -> None:
        """Close the streaming optimizer, and say what its close wrote back: the bucket the
        last step kept on the device, which no iteration's line counts."""
        try:
            store = optimizer.store
        except AssertionError:  # closed already (a cleanup after a failed close): nothing to count
            store = None
        before = store.bytes_written if store is not None else 0
        optimizer.close()
        written = (store.bytes_written - before) if store is not None else 0
        if written:
            self._say(
                f"exit: {size_text(written)} of streamed optimizer state written back (the bucket the "
                "last step kept on the device)"
            )

    def _say(self, line: str) -> None:
        if self.rank == 0:
            tqdm.write(line, file=sys.stdout)
            sys.stdout.flush()
