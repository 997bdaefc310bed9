"""The synthetic verifiable task: reverse a string of digits.

A prompt is ``BOS d1 .. dn SEP``; the right completion is ``dn .. d1``. The reward of a
completion is the fraction of positions it gets right, so it can be checked exactly and
gives partial credit a policy gradient can climb from chance (1/10) towards 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from greenroom.errors import ConfigError

NUM_DIGITS = 10
BOS = NUM_DIGITS
SEP = NUM_DIGITS + 1
VOCAB_SIZE = NUM_DIGITS + 2


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """Shape of the reversal task."""

    digits: int = 4
    """Length of the string to reverse (the completion has the same length)."""

    def __post_init__(self) -> None:
        if not isinstance(self.digits, int) or self.digits <= 0:
            raise ConfigError(f"--digits must be a positive integer, got {self.digits!r}")

    @property
    def prompt_len(self) -> int:
        return self.digits + 2

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.digits


def sample_prompts(config: TaskConfig, n: int, generator: torch.Generator) -> torch.Tensor:
    digits = torch.randint(0, NUM_DIGITS, (n, config.digits), generator=generator)
    bos = torch.full((n, 1), BOS, dtype=torch.long)
    sep = torch.full((n, 1), SEP, dtype=torch.long)
    return torch.cat([bos, digits, sep], dim=1)


def reward(prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
    """Per completion, the fraction of digits equal to the reversed prompt's."""
    target = prompts[:, 1:-1].flip(1).to(completions.device)
    return (completions == target).float().mean(dim=1)
