"""Realistic state for the benches: what a transformer holds after some steps of training.

Compression ratios on random bytes say nothing (nothing compresses) and on freshly
initialised weights too much (zero moments). The compression benches therefore fill
their state from a real training run: greenroom's own ``Transformer`` trained with
AdamW for ``steps`` steps (50 by default) on next-token prediction of random token
sequences, bf16 weights with fp32 masters as mixed precision keeps them. Its flat
weights, masters, moments and last grads are then tiled to the bench's size: a codec
works on one-MiB frames, so repeating a 20M-param model's state changes no frame's
statistics, only how many frames there are.

``train_apart`` runs that training in a child process (``python -m
greenroom.cli.bench.trained``) and takes only its state back, for a bench that reports its
process's host memory: the training itself loads libraries and leaves freed memory behind
(see its docstring), which is the fixture's, not what the bench measures.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

from greenroom.errors import GreenroomError
from greenroom.train.model import ModelConfig, Transformer

BENCH_MODEL = ModelConfig(vocab_size=4096, d_model=512, n_layers=4, n_heads=8, max_seq_len=128)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainedState:
    """The flat state of a trained model (fp32 tensors on one device)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor
    steps: int

    def tiled(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``name`` (repeated as often as needed) in ``dtype``."""
        flat = getattr(self, name)
        reps = -(-numel // flat.numel())
        return flat.repeat(reps)[:numel].to(dtype)


def train(
    device: torch.device, *, steps: int = 50, config: ModelConfig = BENCH_MODEL, batch: int = 16, seed: int = 0
) -> TrainedState:
    """Train ``config`` for ``steps`` AdamW steps on ``device``; its state, flattened."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    torch.manual_seed(seed)
    model = Transformer(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    for _ in range(steps):
        tokens = torch.randint(0, config.vocab_size, (batch, config.max_seq_len), generator=generator).to(device)
        # bf16 autocast on CUDA: the grads and moments of mixed-precision training.
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, config.vocab_size), tokens[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
    params = [p for p in model.parameters() if p in opt.state]

    def flat(get) -> torch.Tensor:
        return torch.cat([get(p).detach().reshape(-1).float() for p in params])

    return TrainedState(
        master=flat(lambda p: p),
        exp_avg=flat(lambda p: opt.state[p]["exp_avg"]),
        exp_avg_sq=flat(lambda p: opt.state[p]["exp_avg_sq"]),
        grad=flat(lambda p: p.grad),
        steps=steps,
    )


def train_apart(device: torch.device, *, steps: int = 50) -> TrainedState:
    """``train(device, steps=steps)`` in a child process; its state, on ``device`` here.

    The training loads what this process would otherwise never hold: on CUDA, cuBLAS and
    the kernels of the model's layers (on the H200 the bench's phase that trains it added
    0.52 GB of host RSS, for good), on the CPU the allocator's freed blocks (about 0.9 GB
    beside the state's 0.27 GB). ``bench stream`` compares its
    host RSS with a peer's process that trains no such model, so it takes the state from a
    child and holds only the state itself (on the device, or on a CPU device the tensors).
    """
    command = [sys.executable, "-m", "greenroom.cli.bench.trained", "--device", str(device), "--steps", str(steps)]
    proc = subprocess.run(command, capture_output=True, check=False)
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise GreenroomError(
            f"--state trained: training the bench's model in a child process failed (exit {proc.returncode}): {tail[0]}"
        )
    return TrainedState(**torch.load(io.BytesIO(proc.stdout), map_location=device, weights_only=True))


def main(argv: list[str] | None = None) -> int:
    """The child of ``train_apart``: train, then write the state to stdout with ``torch.save``."""
    parser = argparse.ArgumentParser(prog="python -m greenroom.cli.bench.trained")
    parser.add_argument("--device", required=True)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # whatever else prints cannot corrupt the state's bytes
    state = train(torch.device(args.device), steps=args.steps)
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    torch.save({name: v.cpu() if isinstance(v, torch.Tensor) else v for name, v in fields.items()}, out)
    out.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
