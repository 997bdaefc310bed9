"""The loop's own settings (``greenroom train``'s flags beside the model's and the task's)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from greenroom.errors import ConfigError
from greenroom.train.model import PRECISIONS


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Settings of the loop (the model's and the task's are separate)."""

    iterations: int = 100
    """Total iterations; a resumed run continues up to this count."""

    role: str = "actor"
    """Which model of the job this is; part of the per-rank dir path."""

    save: str | None = None
    """Checkpoint root: each save writes ``iter_<NNNNNNN>/`` there and, once verified,
    points ``latest_checkpointed_iteration.txt`` at it (``train.rotation``)."""

    keep_last: int = 2
    """With ``save``: how many verified checkpoints stay (older ones go once a newer one is verified)."""

    save_interval: int = 0
    """With ``save``: also save every this many iterations (0: only at the end)."""

    async_save: bool = False
    """With ``save``: publish each save (weights, manifests, meta, the swap) in the
    background, so the next iteration does not wait for it."""

    load: str | None = None
    """A ``save`` root to resume from (its newest good iteration), or one checkpoint dir
    (``DIR/iter_N``, or a single-directory checkpoint); same topology."""

    metrics: str | None = None
    """JSON lines file, one object per iteration (rank 0 writes it; ``""``: none). None:
    ``.run/train-metrics.jsonl``, per job under a scheduler's job id, and beside it while
    another run writes that (``greenroom.train.preflight`` Note [one writer per metrics file])."""

    seed: int = 0
    """Seeds the initial weights and, per iteration and rank, the prompts and sampling."""

    device: str = "auto"
    """``cpu``, ``cuda``, or ``auto`` (cuda when available)."""

    parallel: str = "ddp"
    """``ddp`` or ``fsdp`` (FSDP2) under torchrun."""

    offload_backend: str = "auto"
    """``tms``, ``portable`` or ``auto``; see ``greenroom.actor.build_offloader``."""

    offload_mover: str = "greenroom"
    """On torch_memory_saver: ``greenroom`` (overlapped I/O layer) or ``tms`` (its own copy)."""

    progress: bool = True
    """Show a progress bar per phase."""

    lr: float = 3e-3
    """AdamW learning rate."""

    weight_decay: float = 0.0
    """AdamW's decoupled weight decay (given to either optimizer: their defaults differ)."""

    prompts: int = 32
    """Prompts per rank per iteration."""

    group_size: int = 8
    """Completions sampled per prompt; their mean reward is the baseline."""

    minibatches: int = 4
    """Optimizer steps per iteration, each over an equal share of the completions."""

    dtype: str = "mixed"
    """Parameter precision: ``mixed`` (bf16 matrices, fp32 norms), ``bf16`` or ``fp32``
    (``greenroom.train.model.set_precision``)."""

    clip: float = 0.2
    """PPO ratio clip."""

    reference_policy: bool = False
    """Keep a frozen copy of the initial policy and add a KL penalty towards it, as RL
    trainers do (its weights are device memory the actor holds but never changes)."""

    kl_coef: float = 0.05
    """Weight of the KL penalty (k3 estimator) when ``reference_policy`` is on."""

    def __post_init__(self) -> None:
        for name in ("iterations", "prompts", "group_size", "minibatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.group_size < 2:
            # One completion is its own baseline: the advantage is 0/0, and the first step
            # turned every weight into NaN.
            raise ConfigError(
                f"--group-size {self.group_size}: each prompt needs at least 2 completions (their "
                "mean reward is the baseline each one is compared with)"
            )
        if (self.prompts * self.group_size) % self.minibatches:
            raise ConfigError(
                f"--minibatches {self.minibatches} must divide --prompts x --group-size "
                f"({self.prompts * self.group_size})"
            )
        # inf would train on NaN weights from the first step, as nan or a negative KL weight would.
        if not 0 < self.lr < math.inf:
            raise ConfigError(f"--lr must be positive and finite, got {self.lr}")
        for name in ("weight_decay", "kl_coef"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {getattr(self, name)}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            # Each iteration's generator is seeded from it: past this, torch's overflow error.
            raise ConfigError(f"--seed must be a whole number from 0 to {2**32 - 1}, got {self.seed!r}")
        if self.dtype not in PRECISIONS:
            raise ConfigError(f"--dtype: expected one of {', '.join(PRECISIONS)}, got {self.dtype!r}")
        if not isinstance(self.save_interval, int) or self.save_interval < 0:
            raise ConfigError(f"--save-interval must be a whole number of iterations >= 0, got {self.save_interval!r}")
        if isinstance(self.keep_last, bool) or not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ConfigError(f"--keep-last must be a whole number of checkpoints >= 1, got {self.keep_last!r}")
        if (self.save_interval or self.async_save) and not self.save:
            flag = "--save-interval" if self.save_interval else "--async-save"
            raise ConfigError(f"{flag} needs --save DIR (where the checkpoints go)")
