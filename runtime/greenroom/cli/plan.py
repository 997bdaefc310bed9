"""``greenroom plan``: the run's budget for a set of flags, before anything runs.

Per rank and per node: weights, grads, optimizer state (raw, and the bytes expected on
disk under the codec), pinned staging, host cache, the paused actor's copy, disk bytes;
whether the model state fits the GPU with and without streaming; the HBM a colocated
rollout engine gets while the actor sleeps; whether a node's host memory (given) holds all
its ranks' staging, caches and (cpu target) pinned copies; whether the disk dir has room;
and, given the disk's GB/s (``greenroom bench disk``/``doctor``, or
``--measure-disk``), the expected streamed-step and sleep/wake seconds. The arithmetic is
``greenroom.cli.budget``. Exit 2 when the plan does not fit.

This module holds the flags and the command; the plan as a dict (what ``--json`` prints,
with its problems and their fixes) is ``plan_build``, its text ``plan_text``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from greenroom.cli.budget import SHARDINGS, Layout
from greenroom.cli.plan_build import DEFAULT_CUDA_CONTEXT_GB, DEFAULT_NCCL_GB, build_plan
from greenroom.cli.plan_text import print_plan
from greenroom.config import OffloadConfig, OffloadFlags, add_arguments, default_disk_dir
from greenroom.optim.footprint import PARAM_DTYPES
from greenroom.units import GB, gbps, gigabytes, gigabytes_or_zero, parse_count, positive_int


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser, omit=("no_load_optim",))  # a plan resumes nothing
    run_group = parser.add_argument_group("the run")
    run_group.add_argument(
        "--params", type=parse_count, required=True, metavar="N", help="model parameters: 7B, 70B, 744B, 744e9, 1000000"
    )
    run_group.add_argument(
        "--param-dtype",
        choices=PARAM_DTYPES,
        default="bf16",
        help="dtype of the weights and grads (default %(default)s; 16-bit ones get fp32 masters)",
    )
    run_group.add_argument("--world-size", type=positive_int, default=1, help="number of ranks (GPUs)")
    run_group.add_argument(
        "--nproc-per-node",
        type=positive_int,
        default=None,
        help="ranks per node, sharing its host memory and disk (default: --world-size)",
    )
    run_group.add_argument(
        "--data-parallel",
        type=positive_int,
        default=None,
        help="data-parallel replicas; the model-parallel degree (TP x PP x EP) is "
        "world size / this (default: --world-size)",
    )
    run_group.add_argument(
        "--sharding",
        choices=SHARDINGS,
        default="none",
        help="what is sharded over the data-parallel replicas: none (DDP), optimizer "
        "(ZeRO-1, Megatron's distributed optimizer), full (FSDP, ZeRO-3)",
    )
    run_group.add_argument(
        "--gpu-memory-gb",
        type=gigabytes,
        default=None,
        metavar="GB",
        help="memory of one GPU, GB; without it the GPU fit is not judged",
    )
    run_group.add_argument(
        "--host-memory-gb",
        type=gigabytes,
        default=None,
        metavar="GB",
        help="host memory of one node, GB; without it the host memory is not judged",
    )
    run_group.add_argument(
        "--cuda-context-gb",
        type=gigabytes_or_zero,
        default=DEFAULT_CUDA_CONTEXT_GB,
        metavar="GB",
        help="device memory a rank's CUDA context and kernels keep, GB (an assumption: "
        "nvidia-smi shows an idle rank's)",
    )
    run_group.add_argument(
        "--nccl-gb",
        type=gigabytes_or_zero,
        default=DEFAULT_NCCL_GB,
        metavar="GB",
        help="device memory NCCL's buffers keep per GPU, GB (an assumption: it grows with "
        "communicators, channels and NCCL_BUFFSIZE)",
    )
    run_group.add_argument(
        "--disk-read-gbps",
        type=gbps,
        default=None,
        metavar="GB/S",
        help="the node's disk read bandwidth (greenroom bench disk / doctor measure it)",
    )
    run_group.add_argument(
        "--disk-write-gbps", type=gbps, default=None, metavar="GB/S", help="the node's disk write bandwidth"
    )
    run_group.add_argument(
        "--measure-disk",
        action="store_true",
        help="measure the disk dir's bandwidth with doctor's probe instead of giving it",
    )
    run_group.add_argument("--role", default="actor", help="model role: actor, critic, ...")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def _disk_figures(
    args: argparse.Namespace, config: OffloadFlags, nproc_per_node: int
) -> tuple[tuple[float, float] | None, tuple[float, float] | None, str]:
    """The node's read and write GB/s, its mixed ones (measured only) and their source."""
    given = (args.disk_read_gbps, args.disk_write_gbps)
    if args.measure_disk:
        if any(given):
            raise ValueError(
                "--measure-disk measures what --disk-read-gbps/--disk-write-gbps give: pass one or the other"
            )
        if not config.uses_disk or not os.path.isdir(config.offload_train_disk_dir or ""):
            raise ValueError("--measure-disk needs an existing --offload-train-disk-dir (and a mechanism that uses it)")
        from greenroom.cli.doctor import probe

        # At the node's concurrency: its ranks share the disk (budget Note [node probe]).
        b = probe(config.offload_train_disk_dir, ranks=nproc_per_node)
        mixed = None
        if b.mixed_read_bytes_per_s and b.mixed_write_bytes_per_s:
            mixed = (b.mixed_read_bytes_per_s / GB, b.mixed_write_bytes_per_s / GB)
        return (b.read_bytes_per_s / GB, b.write_bytes_per_s / GB), mixed, "measured"
    if (given[0] is None) != (given[1] is None):
        raise ValueError("--disk-read-gbps and --disk-write-gbps go together: give both")
    return (given if given[0] is not None else None), None, "given"


def _config(args: argparse.Namespace) -> OffloadFlags:
    """The flags as the ranks will use them; with no disk dir anywhere (no flag, no
    $SCRATCH) the budget is still planned, only the free-space check is left out."""
    uses_disk = args.stream_optimizer_state_to_disk or (args.offload_train and args.offload_train_target == "disk")
    if uses_disk and args.offload_train_disk_dir is None and default_disk_dir() is None:
        return OffloadFlags.from_args(args)
    return OffloadConfig.from_args(args)  # built once: its rule warnings print once


def run(args: argparse.Namespace) -> int:
    config = _config(args)
    layout = Layout(
        params=args.params,
        world_size=args.world_size,
        nproc_per_node=args.nproc_per_node or args.world_size,
        data_parallel=args.data_parallel or args.world_size,
        sharding=args.sharding,
        param_dtype=args.param_dtype,
    )
    disk_gbps, mixed_gbps, source = _disk_figures(args, config, layout.nproc_per_node)
    plan = build_plan(
        config,
        layout,
        role=args.role,
        job=os.environ.get("GREENROOM_JOB_ID") or os.environ.get("SLURM_JOB_ID") or "<job>",
        gpu_memory_gb=args.gpu_memory_gb,
        host_memory_gb=args.host_memory_gb,
        disk_gbps=disk_gbps,
        mixed_gbps=mixed_gbps,
        disk_source=source,
        cuda_context_gb=args.cuda_context_gb,
        nccl_gb=args.nccl_gb,
    )
    if args.json:
        print(json.dumps(plan, sort_keys=True))
    else:
        print_plan(plan)
    if plan["problems"]:
        print("greenroom plan: error: " + "; ".join(plan["problems"]), file=sys.stderr)
    return 2 if plan["problems"] else 0
