"""``greenroom bench offload``: actor sleep/wake time and bandwidth for ``--size`` bytes.

The actor here is ``--size`` bytes of random bytes in 1 GiB tensors on the device (CUDA when
available), told to the offloader with ``track()``, plus ``--untracked-size`` more that
nobody names (the frozen reference policy, the EMA copy of a real trainer): the default,
complete offload must find and move those too. One byte of every tensor changes before
each cycle, so every cycle writes everything (an unchanged block would be skipped).
Before the first cycle, untimed, the offloader is readied as ``greenroom train`` readies it
(``Offloader.prepare``: on the disk target the offload file is made and written once with
zeros), so every cycle of the disk target counts in the headline; on the cpu target the
first sleep also pins the host copies, and with ``--mover tms`` torch_memory_saver makes its
own files, so there the headline is the cycles after the first.
Each cycle sleeps and wakes it through the offloader ``greenroom train`` uses, and is
set beside a bound probed in the same process right before it: the raw disk (plain
O_DIRECT threads writing and reading random bytes, ``greenroom.cli.bench.disk.raw_bandwidth``)
for the disk target, a plain copy of the same tensors to one pinned buffer and back for
the cpu target. For the disk, each cycle also reports the rate its stored bytes moved at
over the probe's (``stored_write_ratio``, ``stored_read_ratio``): the part of a ratio
that is greenroom's path and not the codec's. One more probe runs after the last cycle,
so each cycle has a probe on either side (the next cycle's is its after) and is also
judged against the mean of the raw seconds at both (``sleep_time_ratio_bracketed``,
``wake_time_ratio_bracketed``): this disk drifts from one probe to the next, and the
bracketed ratio tells a cycle's spread from the probe's. Each sleep and wake carries where
its time went (``sleep_breakdown``, ``wake_breakdown``: ``greenroom.io.timeline``, the disk
mover's engine) and, where it took more than 1.05x the raw disk's seconds for its stored
bytes (``*_stored_time_ratio``), the line that names the largest share of the disk's idle
time (``*_explanation``, ``greenroom.cli.bench.explain``). After the last wake every
tensor is compared with ``torch.equal`` against a copy kept in memory the offloader
never touches (the rollout region), so a fast but wrong backend cannot pass.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

from greenroom.cli import flags as cliflags
from greenroom.cli.bench import explain
from greenroom.config import OffloadConfig, check_disk_bytes, check_host_bytes
from greenroom.devices import check_device_bytes, resolve_codec, resolve_device
from greenroom.dirs.roots import check_existing_root
from greenroom.errors import ConfigError
from greenroom.io import fs
from greenroom.io.compression import resolve as resolve_compression
from greenroom.io.timeline import Timeline
from greenroom.units import GIB, MIB, bytes_or_zero, parse_bytes, positive_int, rate_text, size_text


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=parse_bytes, default=4 << 30, help="bytes of actor memory (default 4GiB)")
    parser.add_argument(
        "--untracked-size",
        type=bytes_or_zero,
        default=0,
        help="bytes more that the offloader is not told about (default 0)",
    )
    cliflags.target(parser)
    cliflags.disk_dir(
        parser, positional=True, help="disk dir for the per-rank files (node-local NVMe; needed for disk)"
    )
    cliflags.chunk_mb(parser)
    parser.add_argument("--cycles", type=positive_int, default=2, help="sleep/wake cycles (default %(default)s)")
    cliflags.compression(parser, help="codec of the offload file")
    parser.add_argument(
        "--state",
        choices=("random", "trained"),
        default="random",
        help="random: random bytes (nothing compresses); trained: a trained transformer's bf16 "
        "weights, tiled (greenroom.cli.bench.trained)",
    )
    cliflags.backend_and_mover(parser)
    cliflags.device(parser)
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the checksums of the live files (GREENROOM_VERIFY=0): to measure their cost only",
    )
    cliflags.json_flag(parser)


def _pinned_copy_bandwidth(tensors, torch) -> dict:
    """A plain copy of the same tensors out to one pinned buffer, and of that buffer into
    a scratch tensor on the device; the actor's tensors are only read."""
    cuda = tensors[0].is_cuda
    buf = torch.empty(tensors[0].numel(), dtype=torch.uint8, pin_memory=cuda)
    buf.fill_(0)
    scratch = torch.empty_like(tensors[0])
    total = sum(t.numel() for t in tensors)

    def timed(fn) -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for t in tensors:
            fn(t)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    out_s = timed(lambda t: buf[: t.numel()].copy_(t, non_blocking=cuda))
    in_s = timed(lambda t: scratch[: t.numel()].copy_(buf[: t.numel()], non_blocking=cuda))
    return {"out_bytes_per_s": total / out_s, "in_bytes_per_s": total / in_s}


def _check_fits(args: argparse.Namespace, config: OffloadConfig, device) -> None:
    """The actor, its copy and the files fit where they go, checked before any of them
    is made (checked after the relaunch: the process that runs them checks)."""
    from greenroom.cli.bench.disk import RAW_BLOCK

    actor_bytes = args.size + args.untracked_size
    given = fs.human_bytes(args.size) + (
        f" (+ --untracked-size {fs.human_bytes(args.untracked_size)})" if args.untracked_size else ""
    )
    if config.offload_to_disk:
        # The offload file and the raw probe's scratch file of the same bytes, side by side.
        check_disk_bytes(
            "bench offload --size",
            given,
            2 * actor_bytes + RAW_BLOCK,
            config.offload_train_disk_dir,
            counted="the offload file and the raw probe's",
        )
    if device.type == "cuda":
        check_device_bytes("bench offload --size", given, actor_bytes, device, default="4GiB")
    copies = int(device.type == "cpu") + int(not config.offload_to_disk)  # the actor itself, its pinned host copy
    if copies:
        check_host_bytes(
            "bench offload --size",
            given,
            copies * actor_bytes,
            default="4GiB",
            counted="the actor and its host copy" if copies == 2 else "",
        )


def measure(args: argparse.Namespace, *, rank: int = 0, barrier: Callable[[], None] | None = None) -> dict:
    """The run of ``args`` in the rank dir of ``rank``; ``barrier``, where given, is
    called before each cycle's sleep, between its sleep and wake, and after its wake
    (``greenroom bench node``: ranks sharing one disk time each phase together, and no
    rank's probe lands in another's phase)."""
    import torch

    from greenroom import actor
    from greenroom.actor.memory import RssSampler
    from greenroom.cli.bench.disk import raw_bandwidth
    from greenroom.dirs.rankdir import RankDir
    from greenroom.io.engine import verify_default

    device = torch.device(args.device)
    config = OffloadConfig(
        offload_train=True,
        offload_train_target=args.target,
        offload_train_disk_dir=args.dir,
        offload_train_disk_chunk_mb=args.chunk_mb,
        offload_train_disk_compression=args.compression,
    )
    if device.type == "cuda" and args.backend != "portable":
        actor.relaunch_with(actor.launch_env(config, 0, role="bench", mover=args.mover))
    size, untracked_size = args.size, args.untracked_size
    _check_fits(args, config, device)
    rank_dir = None
    sync = barrier or (lambda: None)
    if config.uses_disk:
        rank_dir = RankDir(
            config.offload_train_disk_dir, role="bench", rank=rank, allow_tmpfs=config.allow_tmpfs
        ).open()
    if config.offload_to_disk:
        out_key, in_key = "write_bytes_per_s", "read_bytes_per_s"
    else:
        out_key, in_key = "out_bytes_per_s", "in_bytes_per_s"
    sampler = RssSampler()
    try:
        codec = resolve_codec(config, device)  # once: the offloader's codec and the line printed
        offloader = actor.build_offloader(
            config, rank_dir, device=device, backend=args.backend, mover=args.mover, compression=codec
        )
        with offloader:
            trained = None
            if args.state == "trained":
                from greenroom.cli.bench.trained import train

                trained = train(device)

            def pieces(total: int) -> list:
                if trained is not None:  # bf16 weights: what a sleeping actor mostly holds
                    return [
                        trained.tiled("master", min(GIB, total - start) // 2, torch.bfloat16)
                        for start in range(0, total, GIB)
                    ]
                return [
                    torch.randint(0, 256, (min(GIB, total - start),), dtype=torch.uint8, device=device)
                    for start in range(0, total, GIB)
                ]

            tracked = pieces(size)
            offloader.track(tracked)
            tensors = tracked + pieces(untracked_size)  # the rest is never named
            trained = None  # not part of the actor: let it go before the first sleep

            def bound() -> dict:
                if not config.offload_to_disk:
                    return _pinned_copy_bandwidth(tensors, torch)
                raw = raw_bandwidth(rank_dir.subdir("raw"), size + untracked_size)
                return {
                    "write_bytes_per_s": raw.write_bytes_per_s,
                    "first_write_bytes_per_s": raw.first_write_bytes_per_s,
                    "read_bytes_per_s": raw.read_bytes_per_s,
                    "o_direct": raw.o_direct,
                }

            # The copy kept for the check lives where the offloader never looks (the
            # rollout region).
            with offloader.rollout_region():
                reference = [t.clone() for t in tensors]
            # As greenroom train does before its first iteration: the disk target's file is
            # made and written once here, outside the timed cycles (Offloader.prepare).
            prepared = offloader.prepare()
            rss_before = sampler.rss()
            # Where each sleep's and wake's time goes (greenroom.io.timeline): the disk mover's.
            timeline = Timeline()
            recorded = config.offload_to_disk and offloader.record(timeline)
            cycles = []
            for _ in range(args.cycles):
                # The bound is probed again right before each cycle: this disk's speed
                # drifts between passes, and a cycle is judged against its neighbour.
                cycle_bound = bound()
                for t, r in zip(tensors, reference):
                    t[0] += 1
                    r[0] += 1
                written_before, read_before = offloader.disk_bytes("written"), offloader.disk_bytes("read")
                sampler.reset_peak()
                sync()
                timeline.clear()
                cpu_start, sleep_start = time.process_time(), time.perf_counter()
                slept = offloader.sleep()
                cpu_slept, sleep_end = time.process_time(), time.perf_counter()
                sleep_breakdown = timeline.summary(sleep_start, sleep_end) if recorded else None
                asleep_rss = sampler.rss()
                sync()  # blocks on a semaphore: no CPU seconds of its own in wake_cpu_s
                timeline.clear()
                wake_start = time.perf_counter()
                woke = offloader.wake()
                cpu_woke, wake_end = time.process_time(), time.perf_counter()
                wake_breakdown = timeline.summary(wake_start, wake_end) if recorded else None
                sync()
                sleep_rate, wake_rate = slept.copied / slept.seconds, woke.copied / woke.seconds
                disk_written = offloader.disk_bytes("written") - written_before
                disk_read = offloader.disk_bytes("read") - read_before
                cycles.append(
                    {
                        "sleep_s": slept.seconds,
                        "wake_s": woke.seconds,
                        "sleep_bytes_per_s": sleep_rate,
                        "wake_bytes_per_s": wake_rate,
                        "sleep_copied": slept.copied,
                        "sleep_covered": slept.nbytes,
                        # CPU seconds of the whole process (every thread) in each phase:
                        # over the phase's seconds, the cores it kept busy, spinning
                        # waits on the device included.
                        "sleep_cpu_s": cpu_slept - cpu_start,
                        "wake_cpu_s": cpu_woke - cpu_slept,
                        "disk_bytes_written": disk_written,
                        "disk_bytes_read": disk_read,
                        # The rate the stored bytes moved at over the raw probe's: 1 is
                        # the disk's own speed, less is time lost on greenroom's path
                        # (what the codec saves is not in it).
                        "stored_write_ratio": (
                            disk_written / slept.seconds / cycle_bound[out_key] if config.offload_to_disk else None
                        ),
                        "stored_read_ratio": (
                            disk_read / woke.seconds / cycle_bound[in_key] if config.offload_to_disk else None
                        ),
                        # Seconds over the raw disk's seconds for the stored bytes: the bound a
                        # sleep or wake more than 5 % above explains (``*_explanation``).
                        "sleep_stored_time_ratio": _seconds_over(
                            slept.seconds, disk_written, cycle_bound.get("write_bytes_per_s")
                        ),
                        "wake_stored_time_ratio": _seconds_over(
                            woke.seconds, disk_read, cycle_bound.get("read_bytes_per_s")
                        ),
                        # Each phase's seconds as the disk, the codec, device copies, the host
                        # CPU and waits shared them (greenroom.io.timeline); None where the
                        # mover records none (a host target, torch_memory_saver's own mover).
                        "sleep_breakdown": sleep_breakdown,
                        "wake_breakdown": wake_breakdown,
                        "bound": cycle_bound,
                        "sleep_ratio": sleep_rate / cycle_bound[out_key],
                        "wake_ratio": wake_rate / cycle_bound[in_key],
                        "peak_host_rss": sampler.reset_peak(),
                        "asleep_host_rss": asleep_rss,
                        "tms_pause_s": getattr(offloader, "pause_seconds", None),
                        "tms_resume_s": getattr(offloader, "resume_seconds", None),
                    }
                )
            # One more probe after the last cycle: each cycle then has one on either side
            # (the next cycle's is its after), and is also judged against their mean.
            offloader.record(None)
            _bracket(cycles, bound(), (out_key, in_key))
            for i, c in enumerate(cycles, 1):
                for phase in ("sleep", "wake"):
                    c[f"{phase}_explanation"] = explain.explanation(
                        f"{phase} {i}", c[f"{phase}_breakdown"], c[f"{phase}_stored_time_ratio"], _STORED_BOUND
                    )
            bit_exact = all(torch.equal(t, r) for t, r in zip(tensors, reference))
            backend = offloader.backend
            compression_line = (
                codec.line
                if codec is not None
                else resolve_compression(
                    args.compression, cuda=device.type == "cuda", chunk_bytes=config.chunk_bytes
                ).line
            )
            mover = getattr(offloader, "mover", "greenroom")
    finally:
        sampler.close()
        if rank_dir is not None:
            rank_dir.close()
    # Where the offload file was made and written before the first cycle (``prepared``: the
    # disk target, greenroom's mover) every cycle counts; otherwise the first cycle also did
    # what is done once per run (pinned the host copies on the cpu target; made
    # torch_memory_saver's own files), and the headline is the worst of the cycles after it.
    steady = cycles if prepared.written else (cycles[1:] or cycles)
    return {
        "tracked_bytes": size,
        "untracked_bytes": untracked_size,
        "bytes": size + untracked_size,
        "target": args.target,
        "device": str(device),
        "backend": backend,
        "mover": mover,
        "chunk_mb": args.chunk_mb,
        "verify": verify_default(),
        "dir": config.offload_train_disk_dir,
        "cycles": cycles,
        # Before the first cycle, untimed: the offload file made and written once.
        "prepare_s": prepared.seconds,
        "prepare_written": prepared.written,
        "steady_from_cycle": len(cycles) - len(steady) + 1,
        "bound": cycles[0]["bound"],
        "bit_exact": bit_exact,
        "state": args.state,
        "compression": compression_line,
        "sleep_ratio": min(c["sleep_ratio"] for c in steady),
        "wake_ratio": min(c["wake_ratio"] for c in steady),
        # Seconds over the raw disk's seconds for the same (uncompressed) bytes: under 1
        # is faster than the disk, which only compression can give.
        "sleep_time_ratio": _time_ratio(min(c["sleep_ratio"] for c in steady)),
        "wake_time_ratio": _time_ratio(min(c["wake_ratio"] for c in steady)),
        # The worst of the same cycles, each against the mean of its probes before and after.
        "sleep_time_ratio_bracketed": _worst(c["sleep_time_ratio_bracketed"] for c in steady),
        "wake_time_ratio_bracketed": _worst(c["wake_time_ratio_bracketed"] for c in steady),
        "host_rss_before": rss_before,
        "peak_host_rss": max(c["peak_host_rss"] for c in cycles),
        # The disk target's promise: host memory within the staging chunk plus 1 GiB.
        "host_rss_budget": (rss_before + args.chunk_mb * MIB + GIB) if args.target == "disk" else None,
    }


def _bracket(cycles: list[dict], last_after: dict, keys: tuple[str, str]) -> None:
    """Give each cycle the bound probed after it (the next cycle's, or ``last_after``) and
    its sleep and wake seconds over the mean of the raw seconds at both probes for the
    same bytes (None where nothing was copied)."""
    afters = [c["bound"] for c in cycles[1:]] + [last_after]
    for c, after in zip(cycles, afters):
        c["bound_after"] = after
        for phase, key in zip(("sleep", "wake"), keys):
            # The rate over the harmonic mean of the two probes' rates.
            rate_ratio = c[f"{phase}_bytes_per_s"] * (1 / c["bound"][key] + 1 / after[key]) / 2
            c[f"{phase}_time_ratio_bracketed"] = _time_ratio(rate_ratio)


_STORED_BOUND = "the raw disk's seconds for its stored bytes"


def _seconds_over(seconds: float, stored: int, raw_bytes_per_s: float | None) -> float | None:
    """``seconds`` over the raw disk's seconds for ``stored`` bytes; None without a disk
    bound or stored bytes."""
    return seconds / (stored / raw_bytes_per_s) if raw_bytes_per_s and stored else None


def _worst(time_ratios) -> float | None:
    known = [r for r in time_ratios if r is not None]
    return max(known) if known else None


def _time_ratio(rate_ratio: float) -> float | None:
    """Seconds over the raw disk's seconds; None where nothing was copied (no rate)."""
    return 1 / rate_ratio if rate_ratio > 0 else None


def run(args: argparse.Namespace) -> int:
    if args.size <= 0 or args.cycles <= 0:
        raise ConfigError("bench offload: --size and --cycles must be positive")
    if args.untracked_size < 0:
        raise ConfigError(f"bench offload --untracked-size: expected 0 or more, got {args.untracked_size}")
    cliflags.resolve_disk_dir(args, "bench offload", required=False)
    args.device = resolve_device(args.device, "bench offload")
    if args.no_verify:
        os.environ["GREENROOM_VERIFY"] = "0"  # inherited by the relaunch under torch_memory_saver
    if args.target == "disk" and not (args.dir or os.environ.get("SCRATCH")):
        raise ConfigError(
            "bench offload --offload-train-target disk needs --offload-train-disk-dir DIR on node-local "
            "NVMe (or $SCRATCH)"
        )
    if args.target == "disk" and args.dir:
        check_existing_root(args.dir, name="bench offload --offload-train-disk-dir")
    result = measure(args)
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0 if result["bit_exact"] else 1
    r = result
    print(
        f"bench offload: {size_text(r['tracked_bytes'])} tracked + {size_text(r['untracked_bytes'])} untracked "
        f"on {r['device']}, "
        f"target {r['target']}, backend {r['backend']} (mover {r['mover']}), chunk {r['chunk_mb']} MiB"
        + (f", checksums {'verified' if r['verify'] else 'OFF (--no-verify)'}" if r["target"] == "disk" else "")
    )
    unit = ("write", "read") if r["target"] == "disk" else ("out", "in")
    if r["target"] == "disk":
        print(
            f"  bound: raw disk ({'O_DIRECT' if r['bound']['o_direct'] else 'buffered'}, random bytes, "
            "probed before each cycle)"
        )
    else:
        print("  bound: a plain pinned copy of the same bytes, probed before each cycle")
    if r["prepare_written"]:
        print(
            f"  before cycle 1 (untimed): the offload file made and {size_text(r['prepare_written'])} of zeros "
            f"written once in {r['prepare_s']:.2f}s: the first sleep overwrites written blocks, as later ones do"
        )
    for i, c in enumerate(r["cycles"], 1):
        b = c["bound"]
        print(
            f"  cycle {i}: sleep {c['sleep_s']:.2f}s ({rate_text(c['sleep_bytes_per_s'])}, "
            f"{c['sleep_ratio']:.2f} of {unit[0]} {rate_text(b[unit[0] + '_bytes_per_s'])})  "
            f"wake {c['wake_s']:.2f}s ({rate_text(c['wake_bytes_per_s'])}, "
            f"{c['wake_ratio']:.2f} of {unit[1]} {rate_text(b[unit[1] + '_bytes_per_s'])})  "
            f"moved {size_text(c['sleep_copied'])} of {size_text(c['sleep_covered'])} "
            f"({size_text(c['disk_bytes_written'])} on disk)  "
            f"CPU: sleep {c['sleep_cpu_s']:.2f}s, wake {c['wake_cpu_s']:.2f}s  "
            f"peak host RSS {size_text(c['peak_host_rss'])}"
        )
        for phase in ("sleep", "wake"):
            where = explain.line(
                f"    {phase} {i}", c[f"{phase}_breakdown"], c[f"{phase}_stored_time_ratio"], _STORED_BOUND
            )
            if where is not None:
                print(where)
    which = "every cycle" if r["steady_from_cycle"] == 1 else "cycles 2.."
    if len(r["cycles"]) == 1:
        which = "the cycle"
    print(
        f"  worst of {which} vs its bound: sleep {r['sleep_ratio']:.2f}, wake {r['wake_ratio']:.2f}; "
        f"bit-exact: {r['bit_exact']}; {r['compression']} ({r['state']} state)"
    )
    if r["sleep_time_ratio_bracketed"] is not None and r["wake_time_ratio_bracketed"] is not None:
        print(
            f"  seconds over the raw seconds, worst of {which}, against the mean of the probes before and after "
            f"each (one more probe after the last): sleep {r['sleep_time_ratio_bracketed']:.2f}, "
            f"wake {r['wake_time_ratio_bracketed']:.2f}"
        )
    if r["host_rss_budget"] is not None:
        verdict = "within" if r["peak_host_rss"] <= r["host_rss_budget"] else "OVER"
        print(
            f"  peak host RSS {size_text(r['peak_host_rss'])}, {verdict} the budget "
            f"{size_text(r['host_rss_budget'])} (start + chunk + 1.1 GB)"
        )
    return 0 if r["bit_exact"] else 1
