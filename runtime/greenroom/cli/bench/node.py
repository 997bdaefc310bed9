"""``greenroom bench node``: several ranks streaming and sleeping on one node's disk at once.

Real nodes run 4-8 ranks on one disk. For each count N of ``--ranks`` (default 1,2,4,8) the
bench starts N processes together (on one device: processes on one GPU share its disk as
ranks on N GPUs do), each a rank of its own with its own rank dir under the one DIR
(``RankDir`` with ``rank=k``, as real ranks), and each runs the ``bench stream``
measurement (``--steps`` streamed optimizer steps of ``--params`` params) and then the
``bench offload`` one (``--cycles`` sleep/wake cycles of a ``--size`` actor on the disk
target). A barrier shared by the N ranks (a ``multiprocessing`` one, handed to the two
measurements as their ``barrier`` hook) starts every timed step, sleep and wake of every
rank together and ends it before any rank goes on, so the ranks really share the disk in
each timed phase and no rank's own probe or setup lands in another's phase.

Each rank's state is cut into ``STEP_BUCKETS`` buckets, so that every step after the first
moves all but the one it keeps on the device each way (with one bucket, kept, a later step
would move nothing). The disk's bound for N is a raw probe at N ranks' concurrency
(``greenroom.cli.bench.disk.node_bandwidth``: ``--raw-size`` per rank each way, 4 requests
in flight per rank, and reads beside writes) the parent takes before that run's ranks start
(``greenroom.cli.budget`` Note [node probe]). For each N and each phase (``step``, ``sleep``,
``wake``) the bench reports:

- ``aggregate_bytes_per_s``: the bytes every rank moved through the disk in the phase
  (stored bytes: a step's reads and writes, a sleep's writes, a wake's reads), over
  ``wall_seconds``, the sum over the phase's instances (each step, each cycle's sleep or
  wake) of the slowest rank's seconds in it (the barrier starts them together, so the
  slowest rank's seconds are the node's);
- ``of_disk_bound``: the raw seconds of the same bytes (reads at N's probe's read rate,
  writes at its write rate) over ``wall_seconds``, 1 = the disk's own speed;
- ``vs_one_rank``: the aggregate over the N=1 aggregate of the same run (target >= 0.9);
- ``rank_seconds`` (each rank's seconds summed over the instances), ``rank_over_mean``
  (each over their mean) and ``spread``, the largest of those (target <= 1.10);
- ``plan_seconds``: what ``greenroom plan --measure-disk`` predicts for one instance with N
  ranks on the node (``greenroom.cli.budget.seconds``, ``nproc_per_node=N``, N's probe's
  rates, the step at its mixed ones), given
  the per-rank bytes measured (``plan_bytes_per_rank``: the mean of a step's read and
  written bytes, plan's streamed bytes per step; the stored bytes of a sleep, plan's paused
  actor), beside ``measured_seconds`` (``wall_seconds`` over the instances) and their ratio
  ``plan_ratio`` (target within 15 %);
- ``targets_met``: per target, true or false (null where it has no figure).

Each rank's offload file is made and written once before its first cycle, outside the
timed phases (``Offloader.prepare``, as ``bench offload`` does), and every step and cycle
is counted, the first ones too. Each rank's own measurements still probe the disk (the stream
one with 1 MiB, the offload one with ``--size`` before each cycle and after the last); those
probes run outside the timed phases and no figure here uses them. Every rank's files are
removed when it ends.

This module holds the flags, their checks, the ranks and their figures; the text report is
``node_report``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import threading
import traceback
from dataclasses import asdict

from greenroom.cli import flags as cliflags
from greenroom.config import check_disk_bytes
from greenroom.devices import check_device_bytes, resolve_device
from greenroom.dirs.roots import check_existing_root
from greenroom.errors import ConfigError, GreenroomError
from greenroom.io import fs
from greenroom.log import get_logger
from greenroom.optim.footprint import streamed_bytes_per_param
from greenroom.units import parse_bytes, parse_count, positive_int, rate_text

_log = get_logger(__name__)

PHASES = ("step", "sleep", "wake")
# The targets: the aggregate against one rank's, a rank's seconds against the
# mean of the ranks', and plan's seconds against the measured ones.
AT_LEAST_VS_ONE_RANK = 0.9
AT_MOST_SPREAD = 1.10
PLAN_WITHIN = 0.15
# A count past this is more processes than a node runs ranks (and than its cores start).
MAX_RANKS = 64
# What the ranks' own stream measurement probes (its figures are not used here).
RANK_RAW_SIZE = "1MiB"
# Buckets (and param tensors) per rank's state: a step keeps one on the device, so a later
# step moves 3 of 4.
STEP_BUCKETS = 4


def rank_counts(text: str) -> list[int]:
    """``1,2,4,8`` -> [1, 2, 4, 8]: distinct positive counts, run in the order given."""
    counts = []
    for part in text.split(","):
        try:
            n = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected a comma-separated list of rank counts, e.g. 1,2,4,8"
            ) from None
        if not 0 < n <= MAX_RANKS:
            raise argparse.ArgumentTypeError(f"{text!r}: each rank count must be 1 to {MAX_RANKS}, got {n}")
        if n in counts:
            raise argparse.ArgumentTypeError(f"{text!r}: {n} is given twice")
        counts.append(n)
    return counts


def configure_parser(parser: argparse.ArgumentParser) -> None:
    cliflags.disk_dir(parser, positional=True, help="a dir on the node-local disk the ranks share")
    parser.add_argument(
        "--ranks",
        type=rank_counts,
        default=[1, 2, 4, 8],
        metavar="N,N,...",
        help="rank counts to run, each a run of that many ranks at once; must hold 1 (default 1,2,4,8)",
    )
    parser.add_argument(
        "--params",
        type=parse_count,
        default=100_000_000,
        metavar="N",
        help="bf16 params each rank streams the optimizer state of (default 100M)",
    )
    parser.add_argument(
        "--size", type=parse_bytes, default=1 << 30, help="bytes of each rank's actor, slept and woken (default 1GiB)"
    )
    parser.add_argument("--steps", type=positive_int, default=2, help="timed steps per rank (default %(default)s)")
    parser.add_argument(
        "--cycles", type=positive_int, default=2, help="sleep/wake cycles per rank (default %(default)s)"
    )
    cliflags.moment_dtype(parser)
    cliflags.chunk_mb(parser)
    cliflags.compression(parser, help="codec of every rank's files")
    parser.add_argument(
        "--raw-size",
        type=parse_bytes,
        default=1 << 30,
        help="bytes per rank the parent's raw disk probe moves each way before each rank count's run (default 1GiB)",
    )
    parser.add_argument(
        "--io-only",
        action="store_true",
        help="the steps skip the optimizer arithmetic (bench stream --io-only): the disk's share alone",
    )
    cliflags.backend_and_mover(parser)
    cliflags.device(parser)
    cliflags.json_flag(parser)


def _rank_argv(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The ``bench stream`` and ``bench offload`` arguments every rank runs."""
    common = ["--chunk-mb", str(args.chunk_mb), "--compression", args.compression, "--device", args.device]
    stream = [
        args.dir,
        "--params",
        str(args.params),
        "--bucket-numel",
        str(-(-args.params // STEP_BUCKETS)),
        "--param-numel",  # a param fills a bucket of its own: no param is larger than one
        str(-(-args.params // STEP_BUCKETS)),
        "--steps",
        str(args.steps),
        "--moment-dtype",
        args.moment_dtype,
        "--raw-size",
        RANK_RAW_SIZE,
        *common,
    ] + (["--io-only"] if args.io_only else [])
    offload = [
        args.dir,
        "--size",
        str(args.size),
        "--cycles",
        str(args.cycles),
        "--target",
        "disk",
        "--backend",
        args.backend,
        "--mover",
        args.mover,
        *common,
    ]
    return stream, offload


def _parsed(module, argv: list[str]) -> argparse.Namespace:
    """``argv`` through the bench's own parser: every flag it reads, with its defaults."""
    parser = argparse.ArgumentParser()
    module.configure_parser(parser)
    args = parser.parse_args(argv)
    cliflags.resolve_disk_dir(args, "bench node")
    return args


def _validate(args: argparse.Namespace) -> None:
    from greenroom.cli.bench.disk import RAW_BLOCK, raw_block
    from greenroom.io.engine import align_up

    cliflags.resolve_disk_dir(args, "bench node")
    check_existing_root(args.dir, name="--offload-train-disk-dir")
    if 1 not in args.ranks:
        counts = ",".join(map(str, args.ranks))
        raise ConfigError(
            f"bench node --ranks {counts}: the list must hold 1, the single rank every other count is set "
            f"against (e.g. --ranks 1,{counts})"
        )
    if args.params <= 0 or args.size <= 0 or args.raw_size <= 0 or args.chunk_mb <= 0:
        raise ConfigError("bench node: --params, --size, --raw-size and --offload-train-disk-chunk-mb must be positive")
    if fs.is_memory_backed(args.dir):
        raise ConfigError(
            f"--offload-train-disk-dir {args.dir} is on {fs.mount_of(args.dir).fstype}, which keeps the data "
            "in RAM; point it at the node-local disk the ranks share"
        )
    args.device = resolve_device(args.device, "bench node")
    most = max(args.ranks)
    # At once per rank: its bucket files, or its offload file beside its probe's file of the
    # same bytes; and the parent's probe, removed before the ranks start.
    state = args.params * streamed_bytes_per_param(args.moment_dtype, master_on_disk=True, remainder=True)
    per_rank = max(int(state), 2 * args.size + RAW_BLOCK)
    check_disk_bytes(
        "bench node --ranks",
        f"{most} (each {args.params} params, a {fs.human_bytes(args.size)} actor)",
        most * max(per_rank, align_up(args.raw_size, raw_block(args.raw_size))),
        args.dir,
        counted=f"{most} ranks' bucket files, their offload files and probes, or the parent's probe for {most}",
    )
    if args.device == "cuda":  # on the CPU each rank checks its own host memory as it starts
        check_device_bytes(
            "bench node --ranks",
            f"{most} (each {args.params} params, a {fs.human_bytes(args.size)} actor)",
            most * max(4 * args.params, args.size),
            args.device,
            default=None,
            counted="each rank's bf16 params and grads, then its actor",
        )


def _rank_main(rank: int, job: str, stream_args, offload_args, barrier, results) -> None:
    """One rank: the stream measurement, then the offload one, each phase at the barrier;
    its figures (or its error line) go to ``results``."""
    os.environ["GREENROOM_JOB_ID"] = job  # the node's ranks are one job's, as real ranks are
    try:
        from greenroom.cli.bench import offload, stream_measure

        streamed = stream_measure.measure(stream_args, rank=rank, barrier=barrier.wait)
        _release_device_memory(stream_args.device)
        slept = offload.measure(offload_args, rank=rank, barrier=barrier.wait)
        results.put(
            (
                rank,
                None,
                {
                    "step": [
                        {"seconds": s["seconds"], "read": s["disk_bytes_read"], "written": s["disk_bytes_written"]}
                        for s in streamed["steps"]
                    ],
                    "sleep": [
                        {"seconds": c["sleep_s"], "read": 0, "written": c["disk_bytes_written"]}
                        for c in slept["cycles"]
                    ],
                    "wake": [
                        {"seconds": c["wake_s"], "read": c["disk_bytes_read"], "written": 0} for c in slept["cycles"]
                    ],
                    "bit_exact": slept["bit_exact"],
                    "o_direct": streamed["o_direct"],
                    "state_bytes": streamed["state_bytes"],
                    "compression": streamed["compression"],
                },
            )
        )
    except BaseException as e:
        barrier.abort()  # the other ranks stop at their next barrier instead of waiting for this one
        if not isinstance(e, (GreenroomError, ValueError, threading.BrokenBarrierError)):
            traceback.print_exc()
        results.put((rank, f"{type(e).__name__}: {e}" if not isinstance(e, GreenroomError) else str(e), None))


def _release_device_memory(device: str) -> None:
    """The stream measurement's freed blocks back to the driver before the actor is built:
    torch's cache would otherwise hold them inside the region a sleep pauses."""
    import gc

    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _run_ranks(n: int, job: str, stream_args, offload_args) -> list[dict]:
    """N ranks at once; each rank's figures, in rank order, or the first rank's error."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter per rank, as torchrun starts them
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(k, job, stream_args, offload_args, barrier, results), daemon=False)
        for k in range(n)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple] = {}
    try:
        while len(got) < n:
            try:
                rank, error, figures = results.get(timeout=1.0)
                got[rank] = (error, figures)
            except queue.Empty:
                dead = [k for k, p in enumerate(procs) if k not in got and p.exitcode is not None]
                if dead:
                    barrier.abort()
                    raise GreenroomError(
                        f"bench node: rank {dead[0]} of {n} ended (exit code {procs[dead[0]].exitcode}) "
                        "without its figures; see its output above"
                    ) from None
    finally:
        if len(got) < n:
            barrier.abort()
        for p in procs:
            p.join(timeout=60)
            if p.exitcode is None:
                p.terminate()  # SIGTERM: its rank dirs close and remove their files
                p.join()
    errors = [(k, e) for k, (e, _) in sorted(got.items()) if e is not None]
    if errors:
        # A broken barrier is what the others saw of the failed rank: name that rank.
        k, error = next(((k, e) for k, e in errors if "BrokenBarrierError" not in e), errors[0])
        raise GreenroomError(f"bench node: rank {k} of {n}: {error}")
    return [got[k][1] for k in range(n)]


def _phase(ranks: list[dict], name: str, raw, n: int) -> dict:
    """One phase's figures over the ranks (module docstring)."""
    from greenroom.cli.budget import seconds

    per = [r[name] for r in ranks]
    instances = len(per[0])
    rank_seconds = [sum(i["seconds"] for i in p) for p in per]
    rank_bytes = [sum(i["read"] + i["written"] for i in p) for p in per]
    read = sum(i["read"] for p in per for i in p)
    written = sum(i["written"] for p in per for i in p)
    wall = sum(max(p[j]["seconds"] for p in per) for j in range(instances))
    mean = statistics.fmean(rank_seconds)
    over_mean = [s / mean for s in rank_seconds]
    bound = read / raw.read_bytes_per_s + written / raw.write_bytes_per_s
    count = n * instances
    # What plan is given: a rank's streamed bytes per step (read, then as many written), a
    # sleeping actor's stored bytes (written by a sleep, read by a wake).
    plan_bytes = (read + written) / 2 / count if name == "step" else (written or read) / count
    predicted = seconds(
        {"streamed_per_step": plan_bytes, "paused_actor_stored": plan_bytes},
        nproc_per_node=n,
        read_gbps=raw.read_bytes_per_s / 1e9,
        write_gbps=raw.write_bytes_per_s / 1e9,
        offload_to_disk=True,
        streaming=True,
        mixed_gbps=(raw.mixed_read_bytes_per_s / 1e9, raw.mixed_write_bytes_per_s / 1e9),
    )["streamed_step" if name == "step" else name]
    measured = wall / instances
    plan_ratio = predicted / measured if plan_bytes else None
    return {
        "instances": instances,
        "rank_seconds": rank_seconds,
        "rank_bytes": rank_bytes,
        "rank_over_mean": over_mean,
        "spread": max(over_mean),
        "bytes_read": read,
        "bytes_written": written,
        "bytes": read + written,
        "wall_seconds": wall,
        "aggregate_bytes_per_s": (read + written) / wall,
        "disk_bound_seconds": bound,
        "of_disk_bound": bound / wall,
        "vs_one_rank": None,  # set once the N=1 run is known
        "plan_bytes_per_rank": plan_bytes,
        "plan_seconds": predicted,
        "measured_seconds": measured,
        "plan_ratio": plan_ratio,
        "targets_met": {
            "vs_one_rank": None,
            "spread": max(over_mean) <= AT_MOST_SPREAD,
            "plan": None if plan_ratio is None else abs(plan_ratio - 1) <= PLAN_WITHIN,
        },
    }


def _raw(b) -> dict:
    """A probe's ``Bandwidth`` as the JSON's ``raw`` (its bytes under ``bytes``)."""
    out = asdict(b)
    out["bytes"] = out.pop("nbytes")
    return out


def measure(args: argparse.Namespace) -> dict:
    from greenroom.cli.bench import offload, stream
    from greenroom.cli.bench.disk import node_bandwidth
    from greenroom.dirs.names import job_id
    from greenroom.dirs.rankdir import RankDir

    stream_argv, offload_argv = _rank_argv(args)
    stream_args, offload_args = _parsed(stream, stream_argv), _parsed(offload, offload_argv)
    cliflags.resolve_master_layout(stream_args, "bench node")
    job = job_id()
    runs = []
    for n in args.ranks:
        with RankDir(args.dir, role="bench-node") as probe_dir:
            raw = node_bandwidth(probe_dir.path, args.raw_size, n)
        ranks = _run_ranks(n, job, stream_args, offload_args)
        phases = {name: _phase(ranks, name, raw, n) for name in PHASES}
        runs.append(
            {
                "ranks": n,
                "raw": _raw(raw),
                "phases": phases,
                "bit_exact": all(r["bit_exact"] for r in ranks),
                "o_direct": all(r["o_direct"] for r in ranks),
                "rank_figures": ranks,
            }
        )
        # As each N ends: a run cut short (a time limit) still leaves its figures so far.
        _log.info(
            "bench node: %d rank%s done, raw read %s, write %s; %s",
            n,
            "" if n == 1 else "s",
            rate_text(raw.read_bytes_per_s),
            rate_text(raw.write_bytes_per_s),
            "; ".join(
                f"{name} {rate_text(p['aggregate_bytes_per_s'])}, spread {p['spread']:.3f}, plan/measured "
                + ("-" if p["plan_ratio"] is None else f"{p['plan_ratio']:.2f}")
                for name, p in phases.items()
            ),
        )
    one = next(r for r in runs if r["ranks"] == 1)
    for run_n in runs:
        for name, phase in run_n["phases"].items():
            phase["vs_one_rank"] = phase["aggregate_bytes_per_s"] / one["phases"][name]["aggregate_bytes_per_s"]
            phase["targets_met"]["vs_one_rank"] = phase["vs_one_rank"] >= AT_LEAST_VS_ONE_RANK
    return {
        "dir": os.path.abspath(args.dir),
        "filesystem": fs.mount_of(args.dir).fstype,
        "device": args.device,
        "ranks": args.ranks,
        "params_per_rank": args.params,
        "param_dtype": stream_args.param_dtype,
        "moment_dtype": args.moment_dtype,
        "actor_bytes_per_rank": args.size,
        "steps": args.steps,
        "cycles": args.cycles,
        "io_only": args.io_only,
        "compression": runs[0]["rank_figures"][0]["compression"],
        "raw": one["raw"],  # one rank's probe; each run holds its own
        "targets": {
            "vs_one_rank_at_least": AT_LEAST_VS_ONE_RANK,
            "spread_at_most": AT_MOST_SPREAD,
            "plan_within": PLAN_WITHIN,
        },
        "runs": runs,
    }


def run(args: argparse.Namespace) -> int:
    _validate(args)
    if args.device == "cuda" and args.backend != "portable":
        # Every rank runs under torch_memory_saver's hook: the parent takes it on once
        # (re-executing itself, as bench offload does) and the ranks inherit it.
        from greenroom import actor
        from greenroom.config import OffloadConfig

        config = OffloadConfig(
            offload_train=True,
            offload_train_target="disk",
            offload_train_disk_dir=args.dir,
            offload_train_disk_chunk_mb=args.chunk_mb,
            offload_train_disk_compression=args.compression,
        )
        actor.relaunch_with(actor.launch_env(config, 0, role="bench", mover=args.mover))
    result = measure(args)
    if args.json:
        print(json.dumps(result, sort_keys=True), flush=True)
    else:
        from greenroom.cli.bench.node_report import print_text

        print_text(result)
    return 0 if all(run_n["bit_exact"] for run_n in result["runs"]) else 1
