"""``greenroom train``: the colocated RL job, with actor offload and optimizer streaming.

Per iteration: the actor syncs its weights into the rollout engine and sleeps; the
engine generates completions with a KV cache in the memory the actor gave back; the
completions are scored on the reversal task; the actor wakes and takes PPO-clipped
policy-gradient steps. Runs as one process or under torchrun (DDP or FSDP2; gloo on
the CPU, nccl on CUDA), each rank with its own per-rank dir.
"""

from __future__ import annotations

import argparse
import os

import greenroom
from greenroom.errors import ConfigError
from greenroom.log import get_logger
from greenroom.ranks import launcher_number
from greenroom.train import preflight, rotation
from greenroom.train.config import TrainConfig
from greenroom.train.model import PRECISIONS, ModelConfig
from greenroom.train.task import VOCAB_SIZE, TaskConfig
from greenroom.train.trainer import Trainer

RESUME_MODES = ("strict", "auto")
log = get_logger(__name__)

# Slotted dataclasses keep no class-level defaults: read them from instances.
_TRAIN, _MODEL, _TASK = TrainConfig(), ModelConfig(), TaskConfig()


def configure_parser(parser: argparse.ArgumentParser) -> None:
    greenroom.add_arguments(parser)
    run = parser.add_argument_group("run")
    run.add_argument(
        "--iterations",
        type=int,
        default=_TRAIN.iterations,
        help="total iterations (a resumed run continues up to this count; default %(default)s)",
    )
    run.add_argument("--role", default="actor", help="which model of the job this is (names its per-rank dir)")
    run.add_argument(
        "--save",
        metavar="DIR",
        help="checkpoint root: each save writes DIR/iter_NNNNNNN/ and, once its bytes are verified, "
        "points DIR/latest_checkpointed_iteration.txt at it",
    )
    run.add_argument(
        "--keep-last",
        type=int,
        default=_TRAIN.keep_last,
        metavar="N",
        help="with --save: verified checkpoints kept; older ones go once a newer one is verified "
        "(default %(default)s, so there is always a fallback)",
    )
    run.add_argument(
        "--save-interval",
        type=int,
        default=_TRAIN.save_interval,
        metavar="N",
        help="with --save: also save every N iterations (default 0: only at the end)",
    )
    run.add_argument(
        "--async-save",
        action="store_true",
        help="with --save: publish each checkpoint in the background; the next iteration does not "
        "wait for it (the streamed state is written by the step itself either way)",
    )
    run.add_argument(
        "--load",
        metavar="DIR",
        help="resume from a --save root (its newest good iteration; a damaged one is skipped, said "
        "in one line) or from one checkpoint, DIR/iter_NNNNNNN (same topology)",
    )
    run.add_argument(
        "--resume",
        choices=RESUME_MODES,
        default="strict",
        help="strict (default): --load DIR must hold a checkpoint; auto: a --load DIR that does "
        "not exist yet (or is empty) is a fresh start, so one command serves the first run "
        "and every restart (the chart's and the Slurm templates' default)",
    )
    run.add_argument(
        "--metrics",
        metavar="PATH",
        help="JSON lines, one per iteration, written by this run alone: another run writing PATH "
        f"refuses this one (default {preflight.DEFAULT_METRICS}, or train-metrics-<job>.jsonl "
        "there under $GREENROOM_JOB_ID or $SLURM_JOB_ID; while another run writes it, a "
        "-pid<N> file beside it)",
    )
    run.add_argument("--seed", type=int, default=_TRAIN.seed)
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    run.add_argument(
        "--parallel",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="data parallelism under torchrun: DDP or FSDP2 (default %(default)s)",
    )
    run.add_argument(
        "--offload-backend",
        choices=("auto", "tms", "portable"),
        default="auto",
        help="actor offload backend (default: torch_memory_saver on CUDA, portable elsewhere)",
    )
    run.add_argument(
        "--offload-mover",
        choices=("greenroom", "tms"),
        default="greenroom",
        help="on torch_memory_saver: who copies the bytes (see docs/offload.md)",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bars (summary lines only)")
    opt = parser.add_argument_group("policy optimisation")
    opt.add_argument("--lr", type=float, default=_TRAIN.lr)
    opt.add_argument("--weight-decay", type=float, default=_TRAIN.weight_decay, help="AdamW decoupled weight decay")
    opt.add_argument("--prompts", type=int, default=_TRAIN.prompts, help="prompts per rank per iteration")
    opt.add_argument("--group-size", type=int, default=_TRAIN.group_size, help="completions per prompt")
    opt.add_argument("--minibatches", type=int, default=_TRAIN.minibatches, help="optimizer steps per iteration")
    opt.add_argument(
        "--dtype",
        choices=PRECISIONS,
        default=_TRAIN.dtype,
        help="parameter precision: mixed (bf16 matrices and embeddings, fp32 norms; the default), bf16 or fp32",
    )
    opt.add_argument(
        "--reference-policy",
        action="store_true",
        help="keep a frozen copy of the initial policy and penalise KL towards it",
    )
    opt.add_argument(
        "--kl-coef",
        type=float,
        default=None,
        help=f"KL penalty weight (with --reference-policy; default {_TRAIN.kl_coef})",
    )
    sizes = parser.add_argument_group("model and task sizes")
    sizes.add_argument("--d-model", type=int, default=_MODEL.d_model)
    sizes.add_argument("--n-layers", type=int, default=_MODEL.n_layers)
    sizes.add_argument("--n-heads", type=int, default=_MODEL.n_heads)
    sizes.add_argument("--digits", type=int, default=_TASK.digits, help="length of the string to reverse")


def resume_dir(load: str | None, mode: str) -> str | None:
    """The dir to load, or None for a fresh start: under ``auto`` when nothing was ever
    saved there (no dir, or an empty one, and no save left half-swapped beside it). An
    existing dir that is not a checkpoint stays an error, in either mode."""
    if load is None or mode == "strict":
        return load
    if rotation.has_checkpoint(load):
        return load  # there, or a save killed mid-swap left it beside (--load settles that)
    if os.path.lexists(load) and not (os.path.isdir(load) and not os.listdir(load)):
        return load  # something that is not a checkpoint: the strict checks say what
    log.info(f"--load {load}: no checkpoint there yet (--resume auto): starting fresh")
    return None


def run(args: argparse.Namespace) -> int:
    if args.kl_coef is not None and not args.reference_policy:
        # Without a reference there is no KL term: the weight would be ignored silently.
        raise ConfigError(
            f"--kl-coef {args.kl_coef:g} weighs the KL penalty towards --reference-policy: pass "
            "--reference-policy too, or drop --kl-coef"
        )
    offload = greenroom.OffloadConfig.from_args(args)
    task = TaskConfig(digits=args.digits)
    model = ModelConfig(
        vocab_size=VOCAB_SIZE,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        max_seq_len=task.seq_len,
    )
    config = TrainConfig(
        iterations=args.iterations,
        role=args.role,
        save=args.save,
        keep_last=args.keep_last,
        load=resume_dir(args.load, args.resume),
        save_interval=args.save_interval,
        async_save=args.async_save,
        metrics=args.metrics,
        seed=args.seed,
        device=args.device,
        parallel=args.parallel,
        offload_backend=args.offload_backend,
        offload_mover=args.offload_mover,
        progress=not args.no_progress,
        lr=args.lr,
        weight_decay=args.weight_decay,
        prompts=args.prompts,
        group_size=args.group_size,
        minibatches=args.minibatches,
        dtype=args.dtype,
        reference_policy=args.reference_policy,
        kl_coef=_TRAIN.kl_coef if args.kl_coef is None else args.kl_coef,
    )
    rank = launcher_number("RANK", 0)
    with Trainer(config, offload=offload, model=model, task=task, rank=rank) as trainer:
        trainer.train()
    return 0
