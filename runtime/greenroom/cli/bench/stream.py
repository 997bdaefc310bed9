"""``greenroom bench stream``: streamed optimizer step time against the disk bound.

Builds a ``StreamingAdam`` for ``--params`` parameters (bf16 params by default, so the
fp32 master and both moments stream: 12 B/param in fp32), times ``--steps`` steps and
prints, beside the raw disk bandwidth measured in the same run with plain O_DIRECT
threads (``greenroom.cli.bench.disk.raw_bandwidth``):

- step seconds, disk bytes read and written per step (and their sum), achieved GB/s;
  with ``--stream-optimizer-state-host-cache-gb G`` the buckets that fit in G stay in
  (pinned) host memory and only the rest moves through the disk (run it at 0 and at half
  the state to see what the host tier buys);
- the disk bound ``read / raw read bw + written / raw write bw`` and the ratio step/bound;
  beside the whole-master ratio, the same against the mean of the bounds at that probe
  and at a second one right after the steps (``full_master_ratio_bracketed``): this disk
  drifts between probes, and a bracketed bound tells the step's spread from the probe's;
- peak device memory during the step above what the params and grads hold (flat in N:
  the store's three bucket slots, the scratch, the kernel's temporaries), and during init;
- peak host RSS (sampled) and page-cache growth (``Cached`` in /proc/meminfo);
- the bytes that really went to and came from the disk per step (below the state's
  bytes with ``--compression``), and what 1000 steps write (the SSD's wear);
- with ``--state trained``, the params, grads, masters and moments are those of a
  transformer trained 50 steps (``greenroom.cli.bench.trained``), tiled to ``--params``:
  what a codec meets in training, where ``normal`` (the default) is N(0, 1) params and
  grads with zero moments; that training runs in a child process, so its libraries and
  freed memory are not in the host RSS reported here (nor in ``--against``'s peer);
- with ``--checkpoint``, after the timed steps: one step that writes a checkpoint from its
  own pass (``checkpoint_next_step``) between two plain steps, with its extra seconds
  over their mean, the extra bytes it read (0 when every bucket streams) and wrote, and
  its publish, and how (``mode``: ``link`` where the checkpoint dir takes hard links to
  the bucket files, extra bytes 0; ``write`` elsewhere, a second write of the state); the
  step after it (which writes the linked buckets to new inodes) against the one before;
  the read-back of what the checkpoint shares with the live files (``verify_linked``,
  what ``greenroom train --save`` runs beside the next iteration before the checkpoint
  counts: ``verify_seconds``, ``verify_bytes_read``);
  ``--checkpoint-dir`` puts that checkpoint on another dir (another filesystem: the
  fallback); then a ``save_checkpoint`` between steps beside the state (``save_kind``:
  ``link``, the live files hard-linked, only their checksum tables read; ``clone``
  where links are refused and the filesystem clones extents; ``copy`` elsewhere: its
  seconds, bytes read and written), the same save with ``verify=True`` (the read-back
  before the publish: ``save_verify_seconds``, ``save_verify_bytes_read``) and a verified
  ``load_checkpoint`` of the whole state;
- with ``--io-only``, every step streams and writes back every bucket unchanged, without
  the optimizer's arithmetic: the step's disk I/O and checksums alone, which is what a
  step on the CPU machine (two cores: the arithmetic takes longer than the disk) cannot
  show otherwise, and what a GPU step approaches when the update hides under the I/O;
- with ``--state-dict``, the seconds and GB/s of ``torch.save(opt.state_dict(), f)`` and of
  ``opt.load_state_dict(torch.load(f, mmap=True))``, then the same through
  ``torch.distributed.checkpoint`` (one process), each with peak host RSS and its
  anonymous part (RSS less the file-backed pages the kernel can drop).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
import warnings

import psutil

from greenroom.actor.memory import RssSampler
from greenroom.cli import flags as cliflags
from greenroom.config import check_disk_bytes, check_host_bytes
from greenroom.devices import check_device_bytes, resolve_device
from greenroom.dirs.rankdir import check_existing_root
from greenroom.errors import ConfigError, GreenroomError
from greenroom.io import fs
from greenroom.optim.footprint import streamed_bytes_per_param
from greenroom.optim.store.bucket_store import DEFAULT_BUCKET_NUMEL
from greenroom.units import GB, MIB, parse_bytes, parse_count, rate_text, size_text

PARAM_NUMEL = 50_000_000


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params",
        type=parse_count,
        required=True,
        metavar="N",
        help="parameters to optimize (1B, 2e9, 500000000, ...)",
    )
    cliflags.disk_dir(parser, required=True, positional=True, help="a dir on node-local NVMe for the bucket files")
    cliflags.moment_dtype(parser)
    parser.add_argument(
        "--param-dtype",
        choices=("bf16", "fp32"),
        default="bf16",
        help="bf16: master and moments stream, 10.014 B/param stored with fp32 moments in the default "
        "master layout (remainder; 12 with --master-layout fp32); fp32: moments only (8 B/param)",
    )
    cliflags.master_layout(parser)
    parser.add_argument("--steps", type=int, default=2, help="timed steps (default %(default)s)")
    parser.add_argument("--bucket-numel", type=int, default=DEFAULT_BUCKET_NUMEL, help="elements per bucket")
    parser.add_argument("--param-numel", type=int, default=PARAM_NUMEL, help="elements per param tensor")
    cliflags.chunk_mb(parser)
    cliflags.host_cache_gb(parser)
    parser.add_argument(
        "--raw-size", type=parse_bytes, default=2 << 30, help="bytes the raw disk probe moves each way (default 2GiB)"
    )
    cliflags.compression(parser, help="codec of the bucket files")
    parser.add_argument(
        "--state",
        choices=("normal", "trained"),
        default="normal",
        help="normal: N(0,1) params and grads, zero moments; trained: a trained transformer's state, tiled",
    )
    cliflags.device(parser)
    parser.add_argument(
        "--checkpoint",
        action="store_true",
        help="also time a step that writes a checkpoint in its own pass and the read-back of "
        "what it links, save_checkpoint between steps (without and with verify=True), and "
        "load_checkpoint (dirs beside the bucket files)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="with --checkpoint: where the in-step checkpoint goes (a rank dir of the bench's under "
        "DIR, removed after); default beside the bucket files",
    )
    parser.add_argument(
        "--io-only",
        action="store_true",
        help="skip the optimizer arithmetic: each step streams every bucket back unchanged (its disk "
        "I/O and checksums alone)",
    )
    parser.add_argument(
        "--state-dict",
        action="store_true",
        help="also time torch.save(opt.state_dict()) / load_state_dict, and the same through DCP",
    )
    parser.add_argument("--allow-tmpfs", action="store_true", help="accept a memory-backed dir (tests only)")
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the checksums of the live files (GREENROOM_VERIFY=0): to measure their cost only",
    )
    parser.add_argument(
        "--against",
        choices=("deepspeed",),
        default=None,
        help="then run DeepSpeed ZeRO-Infinity (NVMe optimizer offload) on the same params, dtype and "
        "dir in a child process, and report both (needs CUDA and the deepspeed extra)",
    )
    cliflags.json_flag(parser)


def _check_fits(args: argparse.Namespace) -> None:
    """The params, their grads and the bucket files fit where they go, checked before
    any is made."""
    from greenroom.cli.bench.disk import RAW_BLOCK
    from greenroom.io.engine import align_up

    n = args.params
    param_bytes = 2 if args.param_dtype == "bf16" else 4
    # Params and grads; a trained state is tiled first and cloned, so twice that for a moment.
    tensors = n * param_bytes * (4 if args.state == "trained" else 2)
    check_device_bytes(
        "bench stream --params",
        n,
        tensors,
        args.device,
        default=None,
        counted=f"{param_bytes} B per param and per grad",
    )
    state = n * streamed_bytes_per_param(
        args.moment_dtype, master_on_disk=args.param_dtype == "bf16", remainder=args.master_layout == "remainder"
    )
    check_disk_bytes(
        "bench stream --params",
        f"{n} (+ --raw-size {fs.human_bytes(args.raw_size)})",
        int(state) + align_up(args.raw_size, RAW_BLOCK),
        args.dir,
        counted="the bucket files and the raw probe's",
    )


def _validate(args: argparse.Namespace) -> None:
    cliflags.resolve_disk_dir(args, "bench stream")
    args.device = resolve_device(args.device, "bench stream")
    for flag in ("steps", "bucket_numel", "param_numel", "chunk_mb"):
        if getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    check_host_bytes("--offload-train-disk-chunk-mb", args.chunk_mb, args.chunk_mb * MIB)
    cliflags.resolve_master_layout(args, "bench stream")
    cache = args.stream_optimizer_state_host_cache_gb
    if not 0 <= cache < math.inf:
        raise ConfigError(f"--stream-optimizer-state-host-cache-gb must be a finite number of GB >= 0, got {cache!r}")
    if cache:
        check_host_bytes(
            "--stream-optimizer-state-host-cache-gb",
            f"{cache:g}",
            int(cache * GB) + args.chunk_mb * MIB,
            default=0,
            counted="the host cache plus the pinned staging",
        )
    check_existing_root(args.dir, name="--offload-train-disk-dir")
    if args.checkpoint_dir is not None:
        if not args.checkpoint:
            raise ConfigError("--checkpoint-dir needs --checkpoint")
        check_existing_root(args.checkpoint_dir, name="--checkpoint-dir")
    if args.against == "deepspeed":
        from greenroom.cli.bench import peer

        peer.check_deepspeed(args)
    _check_fits(args)
    if fs.is_memory_backed(args.dir) and not args.allow_tmpfs:
        raise ConfigError(
            f"--offload-train-disk-dir {args.dir} is on {fs.mount_of(args.dir).fstype}, which keeps "
            "the data in RAM; point it at node-local NVMe (or pass --allow-tmpfs for a test)"
        )


def measure(args: argparse.Namespace) -> dict:
    import torch

    from greenroom.cli.bench.disk import raw_bandwidth
    from greenroom.dirs.rankdir import RankDir
    from greenroom.optim import StreamingAdam

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    rss_phases = {"start": _rss_now()}
    if cuda:
        torch.empty(1, device=device)  # the CUDA context alone, before the fixture and the params
        rss_phases["cuda_context"] = _rss_now()
    n = int(args.params)
    dtype = torch.bfloat16 if args.param_dtype == "bf16" else torch.float32
    sizes = [min(args.param_numel, n - start) for start in range(0, n, args.param_numel)]
    trained = None
    if args.state == "trained":
        from greenroom.cli.bench.trained import train_apart

        trained = train_apart(device)  # the training's own libraries and garbage stay in its process
        flat_param = trained.tiled("master", n, dtype)
        flat_grad = trained.tiled("grad", n, dtype)
        params = [torch.nn.Parameter(t.clone()) for t in flat_param.split(sizes)]
        for p, g in zip(params, flat_grad.split(sizes)):
            p.grad = g.clone()
        del flat_param, flat_grad
    else:
        params = [torch.nn.Parameter(torch.empty(s, dtype=dtype, device=device).normal_()) for s in sizes]
        for p in params:
            p.grad = torch.empty_like(p).normal_()

    rss_phases["params"] = _rss_now()  # the params and grads (host memory only on a CPU device), the trained state

    def allocated() -> int | None:
        if not cuda:
            return None
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)

    with RankDir(args.dir, role="bench-stream", allow_tmpfs=args.allow_tmpfs) as rank_dir:
        raw = raw_bandwidth(rank_dir.subdir("raw"), max(args.raw_size, 1 << 20), mixed=True)
        base = allocated()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        with RssSampler(0.02, page_cache=True) as init_host:
            start = time.perf_counter()
            opt = StreamingAdam(
                params,
                lr=1e-4,
                weight_decay=0.01,
                state_dir=rank_dir,
                bucket_numel=args.bucket_numel,
                moment_dtype=args.moment_dtype,
                chunk_mb=args.chunk_mb,
                resident_numel=0,
                compression=args.compression,
                host_cache_gb=args.stream_optimizer_state_host_cache_gb,
                master_layout=args.master_layout,
            )
            allocated()
            init_seconds = time.perf_counter() - start
        rss_phases["optimizer"] = _rss_now()  # + the store: its staging, files' records, (on a CPU device) buffers
        if trained is not None:
            _fill_trained(opt, trained)
        if args.io_only:
            opt._step_bucket = lambda bucket_state: None  # the stream reads, verifies and writes back as always
        init_peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
        try:
            steps = []
            rss_before = psutil.Process().memory_info().rss
            with RssSampler(0.02, page_cache=True) as host:
                for _ in range(args.steps):
                    read0, written0 = opt.store.bytes_read, opt.store.bytes_written
                    disk_read0, disk_written0 = opt.store.disk_bytes("read"), opt.store.disk_bytes("written")
                    before = allocated()
                    if cuda:
                        torch.cuda.reset_peak_memory_stats(device)
                    start, cpu_start = time.perf_counter(), time.process_time()
                    opt.step()
                    allocated()
                    seconds = time.perf_counter() - start
                    steps.append(
                        {
                            "seconds": seconds,
                            # The process's CPU seconds (every thread's, spinning waits on the
                            # device included): over ``seconds``, the cores the step kept busy.
                            "cpu_seconds": time.process_time() - cpu_start,
                            "bytes_read": opt.store.bytes_read - read0,
                            "bytes_written": opt.store.bytes_written - written0,
                            "disk_bytes_read": opt.store.disk_bytes("read") - disk_read0,
                            "disk_bytes_written": opt.store.disk_bytes("written") - disk_written0,
                            "disk_bytes": (
                                opt.store.disk_bytes("read")
                                - disk_read0
                                + opt.store.disk_bytes("written")
                                - disk_written0
                            ),
                            "peak_device_bytes": (torch.cuda.max_memory_allocated(device) - before if cuda else None),
                            # All the process holds, params and grads too: what a peer reports.
                            "peak_device_total_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
                        }
                    )
            rss_phases["steps"] = _rss_now()
            kept_bytes = opt.store.kept_bytes  # before a checkpoint or state dict writes it back
            # This disk's speed drifts from one probe to the next: a second probe right
            # after the steps brackets them (reported beside the headline, which keeps the first).
            raw_after = raw_bandwidth(rank_dir.subdir("raw"), max(args.raw_size, 1 << 20))
            pinned = _pinned_host_stats() if cuda else None
            checkpoint = None
            if args.checkpoint and args.checkpoint_dir is not None:
                with RankDir(args.checkpoint_dir, role="bench-stream-checkpoint", allow_tmpfs=True) as checkpoint_dir:
                    checkpoint = _time_checkpoint(
                        opt, rank_dir.subdir("checkpoint"), allocated, in_step_dir=checkpoint_dir.subdir("in-step")
                    )
            elif args.checkpoint:
                checkpoint = _time_checkpoint(opt, rank_dir.subdir("checkpoint"), allocated)
            state_dict = _time_state_dict(opt, rank_dir.subdir("state-dict")) if args.state_dict else None
            state_bytes = opt.store.state_bytes
            buckets = len(opt.store.buckets)
            largest_bucket = opt.store.max_bucket_bytes
            largest_bucket_numel = max((b.numel for b in opt.store.buckets), default=0)
            cached_buckets, host_cache_bytes = len(opt.store.host_cache), opt.store.host_cache_bytes
            direct = all(f.direct for f in opt.store.files)
            verify = opt.store.engine.verify
            compression_line = opt.compression_line
        finally:
            opt.close()

    last = steps[-1]
    bound = last["bytes_read"] / raw.read_bytes_per_s + last["bytes_written"] / raw.write_bytes_per_s
    # What the whole-fp32-master layout moves without a codec (12 B/param with fp32
    # moments): the bound the targets are stated against.
    # What a step whose reads and write-backs overlap fully could reach on this disk.
    overlapped = (
        max(
            last["disk_bytes_read"] / raw.mixed_read_bytes_per_s,
            last["disk_bytes_written"] / raw.mixed_write_bytes_per_s,
        )
        if raw.mixed_read_bytes_per_s
        else None
    )
    full_bytes = n * streamed_bytes_per_param(args.moment_dtype, master_on_disk=args.param_dtype == "bf16")
    full_bound = full_bytes / raw.read_bytes_per_s + full_bytes / raw.write_bytes_per_s
    full_bound_after = full_bytes / raw_after.read_bytes_per_s + full_bytes / raw_after.write_bytes_per_s
    staging = args.chunk_mb * MIB
    return {
        "params": n,
        "param_dtype": args.param_dtype,
        "moment_dtype": args.moment_dtype,
        "device": str(device),
        "dir": os.path.abspath(args.dir),
        "filesystem": fs.mount_of(args.dir).fstype,
        "o_direct": direct,
        "bucket_numel": args.bucket_numel,
        "param_numel": args.param_numel,
        "buckets": buckets,
        "largest_bucket_bytes": largest_bucket,
        "largest_bucket_numel": largest_bucket_numel,
        "state_bytes": state_bytes,
        "chunk_bytes": staging,
        # The bucket the last step left on the device (optim.store.held Note [the last bucket
        # stays]): a step after another one neither reads it nor writes it back.
        "kept_bucket_bytes": kept_bytes,
        "host_cache_budget_bytes": int(args.stream_optimizer_state_host_cache_gb * GB),
        "host_cache_bytes": host_cache_bytes,
        "cached_buckets": cached_buckets,
        "raw_read_bytes_per_s": raw.read_bytes_per_s,
        "raw_write_bytes_per_s": raw.write_bytes_per_s,
        "init_seconds": init_seconds,
        "init_peak_device_bytes": init_peak,
        "step_seconds": last["seconds"],
        "steps": steps,
        "bytes_read": last["bytes_read"],
        "bytes_written": last["bytes_written"],
        "disk_bytes_read": last["disk_bytes_read"],
        "disk_bytes_written": last["disk_bytes_written"],
        "disk_bytes": last["disk_bytes_read"] + last["disk_bytes_written"],
        "disk_bytes_written_per_1000_steps": 1000 * last["disk_bytes_written"],
        # None where nothing went to disk (every bucket cached): no ratio, not 0x.
        "stored_ratio": (last["bytes_written"] / last["disk_bytes_written"] if last["disk_bytes_written"] else None),
        "compression": compression_line,
        "state": args.state,
        "io_only": args.io_only,
        "achieved_bytes_per_s": (last["bytes_read"] + last["bytes_written"]) / last["seconds"],
        # All cached: no disk I/O in the step, so no disk bound to compare with.
        "disk_bound_seconds": bound,
        "ratio": last["seconds"] / bound if bound else None,
        "raw_mixed_read_bytes_per_s": raw.mixed_read_bytes_per_s,
        "raw_mixed_write_bytes_per_s": raw.mixed_write_bytes_per_s,
        "overlapped_bound_seconds": overlapped,
        "overlapped_ratio": last["seconds"] / overlapped if overlapped else None,
        "master_layout": args.master_layout,
        # The first step reads every bucket: the whole state as stored.
        "disk_bytes_per_param": steps[0]["disk_bytes_read"] / n,
        "full_master_bytes": full_bytes,
        "full_master_bound_seconds": full_bound,
        "full_master_ratio": last["seconds"] / full_bound,
        "raw_after_read_bytes_per_s": raw_after.read_bytes_per_s,
        "raw_after_write_bytes_per_s": raw_after.write_bytes_per_s,
        # Against the mean of the whole-master bounds at the probes before and after the steps.
        "full_master_ratio_bracketed": last["seconds"] / ((full_bound + full_bound_after) / 2),
        "peak_device_step_bytes": max((s["peak_device_bytes"] for s in steps), default=None) if cuda else None,
        "peak_device_total_bytes": max((s["peak_device_total_bytes"] for s in steps), default=None) if cuda else None,
        "host_rss_before_bytes": rss_before,
        "host_rss_peak_bytes": host.peak,
        "init_host_rss_peak_bytes": init_host.peak,  # the optimizer's construction (and its first writes)
        # Where the host memory went: RSS and its anonymous part after each phase, and
        # torch's pinned host allocator (which rounds a block up to a power of two).
        "host_rss_phases": rss_phases,
        "pinned_host": pinned,
        # rss_before already holds the host cache (filled at init): the step adds staging at most.
        "host_rss_budget_bytes": rss_before + staging + (1 << 30),
        "page_cache_growth_bytes": host.cached_peak - host.cached_before,
        "init_page_cache_growth_bytes": init_host.cached_peak - init_host.cached_before,
        "checkpoint": checkpoint,
        "state_dict": state_dict,
        "verify": verify,
    }


def _buckets_words(r: dict) -> str:
    """The buckets as built: a param larger than ``--bucket-numel`` gets a bucket of its
    own, so the largest may exceed it."""
    count = f"{r['buckets']} bucket{'s' if r['buckets'] != 1 else ''}"
    largest = f"largest {r['largest_bucket_numel']:,} elements ({size_text(r['largest_bucket_bytes'])})"
    if r["largest_bucket_numel"] > r["bucket_numel"]:
        return (
            f"{count}, {largest}: a param over --bucket-numel {r['bucket_numel']:,} gets a bucket of its own "
            f"(--param-numel {r['param_numel']:,})"
        )
    return f"{count} of up to --bucket-numel {r['bucket_numel']:,} elements, {largest}"


def _why_no_io(r: dict) -> str:
    """Why a step moved nothing through the disk: the bucket the last step kept on the
    device, the host cache's buckets, or both, hold all of the state."""
    reasons = []
    if r["kept_bucket_bytes"]:
        reasons.append(
            "the one bucket stayed on the device between steps"
            if r["buckets"] == 1
            else "the bucket kept on the device between steps"
        )
    if r["cached_buckets"]:
        reasons.append(f"{r['cached_buckets']} of {r['buckets']} buckets in the host cache")
    return " and ".join(reasons) or "nothing streams"


def _rss_now() -> dict:
    """This process's RSS and its anonymous part (RSS less file-backed pages), bytes."""
    info = psutil.Process().memory_info()
    return {"rss": info.rss, "anon": info.rss - info.shared}


def _pinned_host_stats() -> dict | None:
    """The byte counts of torch's pinned host allocator (None where this torch lacks them)."""
    import torch

    try:
        stats = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):
        return None
    return {k: v for k, v in stats.items() if "bytes" in k and k.endswith((".current", ".peak"))}


def _fill_trained(opt, trained) -> None:
    """Masters and moments of every bucket from the trained state, tiled in bucket order."""
    import torch

    cursor = [0]

    def fill(state) -> None:
        n = state.bucket.numel
        for name, flat in (("master", state.master), ("exp_avg", state.exp_avg), ("exp_avg_sq", state.exp_avg_sq)):
            if flat is not None:
                whole = getattr(trained, name)
                index = torch.arange(cursor[0], cursor[0] + n, device=whole.device) % whole.numel()
                flat.copy_(whole[index])
        cursor[0] += n

    opt.store.overwrite(fill)


def _time_checkpoint(opt, directory: str, synchronize, in_step_dir: str | None = None) -> dict:
    """A plain step, a step that writes a checkpoint in its own pass (into
    ``in_step_dir``, default beside the rest), a plain step; then a save between steps
    and a verified load of the whole state."""

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        synchronize()
        return time.perf_counter() - start

    in_step_path = os.path.join(in_step_dir or directory, "in-step")
    store = opt.store
    with RssSampler(0.02, page_cache=True) as host:
        before = timed(opt.step)
        opt.checkpoint_next_step(in_step_path)
        read0, written0 = store.disk_bytes("read"), store.disk_bytes("written")
        checkpointed = timed(opt.step)
        step_read, step_written = store.disk_bytes("read") - read0, store.disk_bytes("written") - written0
        written = opt.last_checkpoint
        after = timed(opt.step)
        start = time.perf_counter()
        verify_read = opt.verify_linked(in_step_path)
        verify = time.perf_counter() - start
        plain = (before + after) / 2
        in_step = {
            "mode": written.mode,
            "step_seconds": checkpointed,
            "plain_step_seconds": [before, after],
            "extra_seconds": checkpointed - plain,
            "ratio": checkpointed / plain,
            "ratio_to_step_before": checkpointed / before,
            "step_after_ratio": after / before,
            "extra_bytes_read": written.extra_bytes_read,
            "extra_bytes_written": written.extra_bytes_written,
            "step_disk_bytes_read": step_read,
            "step_disk_bytes_written": step_written,
            "publish_seconds": written.publish_seconds,
            "verify_seconds": verify,
            "verify_bytes_read": verify_read,
        }
        shutil.rmtree(in_step_path)  # the disk holds the live state and one checkpoint at a time
        path = os.path.join(directory, "optim")
        start = time.perf_counter()
        moved = opt.save_checkpoint(path)
        save = time.perf_counter() - start
        start = time.perf_counter()
        verified = opt.save_checkpoint(path, verify=True)
        save_verify = time.perf_counter() - start
        start = time.perf_counter()
        opt.load_checkpoint(path)
        load = time.perf_counter() - start
    return {
        "in_step": in_step,
        "save_kind": moved["kind"],
        "save_seconds": save,
        "save_bytes_read": moved["bytes_read"],
        "save_bytes_written": moved["bytes_written"],
        "save_verify_seconds": save_verify,
        "save_verify_bytes_read": verified["bytes_read"],
        "load_seconds": load,
        "bytes": opt.store.state_bytes,
        "page_cache_growth_bytes": host.cached_peak - host.cached_before,
    }


def _time_state_dict(opt, directory: str) -> dict:
    """torch.save / load_state_dict of the whole state, then the same through DCP; each
    phase with its seconds, the bytes it wrote or read, peak RSS and peak anonymous RSS
    (the part that is no dropable page cache) above what the process held before."""
    import torch
    import torch.distributed.checkpoint as dcp

    def phase(fn) -> dict:
        info = psutil.Process().memory_info()
        with RssSampler(0.02, page_cache=True) as host:
            start = time.perf_counter()
            fn()
            seconds = time.perf_counter() - start
        return {
            "seconds": seconds,
            "rss_growth_bytes": host.peak - info.rss,
            "anon_growth_bytes": host.anon_peak - (info.rss - info.shared),
            "page_cache_growth_bytes": host.cached_peak - host.cached_before,
        }

    def fsynced(fn):
        def wrapped() -> None:
            fn()
            os.sync()  # the seconds include getting the bytes to the disk, as the bucket writes do

        return wrapped

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process on purpose
    out = {}
    path = os.path.join(directory, "optim.pt")
    out["torch_save"] = phase(fsynced(lambda: torch.save(opt.state_dict(), path)))
    out["torch_save"]["bytes"] = os.path.getsize(path)
    out["torch_load"] = phase(lambda: opt.load_state_dict(torch.load(path, mmap=True, weights_only=True)))
    out["torch_load"]["bytes"] = os.path.getsize(path)
    os.unlink(path)
    dcp_dir = os.path.join(directory, "dcp")
    out["dcp_save"] = phase(fsynced(lambda: dcp.save({"optim": opt.state_dict()}, checkpoint_id=dcp_dir)))

    def dcp_load() -> None:
        template = {"optim": opt.state_dict()}
        dcp.load(template, checkpoint_id=dcp_dir)
        opt.load_state_dict(template["optim"])

    out["dcp_load"] = phase(dcp_load)
    size = sum(os.path.getsize(os.path.join(dcp_dir, f)) for f in os.listdir(dcp_dir))
    out["dcp_save"]["bytes"] = out["dcp_load"]["bytes"] = size
    shutil.rmtree(dcp_dir)
    return out


def run(args: argparse.Namespace) -> int:
    _validate(args)
    if args.no_verify:
        os.environ["GREENROOM_VERIFY"] = "0"
    result = measure(args)
    peer_failed = None
    if args.against == "deepspeed":
        from greenroom.cli.bench import peer

        try:
            result["against"] = peer.beside_deepspeed(args, result)
        except GreenroomError as e:  # greenroom's own figures are still printed, then the peer's failure
            peer_failed = e
            result["against"] = {"error": str(e)}
    if args.json:
        print(json.dumps(result, sort_keys=True), flush=True)
        if peer_failed is not None:
            raise peer_failed
        return 0
    r = result
    print(
        f"bench stream: {r['params']:,} {r['param_dtype']} params, {r['moment_dtype']} moments, on {r['device']}; "
        f"{_buckets_words(r)}, state {size_text(r['state_bytes'])} "
        f"in {r['dir']} ({r['filesystem']}, O_DIRECT {'on' if r['o_direct'] else 'off'}, "
        f"checksums {'verified' if r['verify'] else 'OFF (--no-verify)'})"
    )
    if r["host_cache_budget_bytes"]:
        print(
            f"host cache: {r['cached_buckets']} of {r['buckets']} buckets, {size_text(r['host_cache_bytes'])} of "
            f"{size_text(r['host_cache_budget_bytes'])} ({'pinned' if r['device'].startswith('cuda') else 'plain'} "
            "host memory); the rest streams"
        )
    print(
        f"raw disk (same run): read {rate_text(r['raw_read_bytes_per_s'])}, "
        f"write {rate_text(r['raw_write_bytes_per_s'])}"
    )
    init_device = r["init_peak_device_bytes"]
    print(
        f"init: {r['init_seconds']:.2f} s"
        + (f", peak device {size_text(init_device)}" if init_device is not None else "")
    )
    for i, s in enumerate(r["steps"], 1):
        moved = (
            f"on disk {size_text(s['disk_bytes'])}, {rate_text(s['disk_bytes'] / s['seconds'])}"
            if s["disk_bytes"]
            else f"no disk I/O, no bandwidth measured ({_why_no_io(r)})"
        )
        print(
            f"step {i}: {s['seconds']:.2f} s, state read {size_text(s['bytes_read'])} + written "
            f"{size_text(s['bytes_written'])}, {moved}, CPU {s['cpu_seconds']:.2f} s"
            + (f", peak device +{size_text(s['peak_device_bytes'])}" if s["peak_device_bytes"] is not None else "")
        )
    if r["kept_bucket_bytes"]:
        print(
            f"between steps one bucket ({size_text(r['kept_bucket_bytes'])}) stays on the device: a step after "
            "another reads and writes that much less"
        )
    if r["ratio"] is None:
        print(f"disk bound 0 s: the last step moved nothing through the disk ({_why_no_io(r)}); no step/bound ratio")
    else:
        print(f"disk bound {r['disk_bound_seconds']:.2f} s, step/bound {r['ratio']:.2f}")
    if r["overlapped_ratio"] is not None:
        print(
            f"reads and writes at once (same run): read {rate_text(r['raw_mixed_read_bytes_per_s'])}, write "
            f"{rate_text(r['raw_mixed_write_bytes_per_s'])}; a fully overlapped step's bound "
            f"{r['overlapped_bound_seconds']:.2f} s, step / it {r['overlapped_ratio']:.2f}"
        )
    masters = f"masters {r['master_layout']}: {r['disk_bytes_per_param']:.3f} disk bytes/param stored"
    if r["ratio"] is None:  # a step that moved nothing is not compared with a bound that moves everything
        print(masters)
    else:
        print(
            f"{masters}; step / bound of the uncompressed whole-master {r['full_master_bytes'] / r['params']:g} "
            f"B/param ({r['full_master_bound_seconds']:.2f} s) {r['full_master_ratio']:.2f}; with a probe after "
            f"the steps too (read {rate_text(r['raw_after_read_bytes_per_s'])}, write "
            f"{rate_text(r['raw_after_write_bytes_per_s'])}), against the mean of both bounds "
            f"{r['full_master_ratio_bracketed']:.2f}"
        )
    print(
        f"{r['compression']}; {r['state']} state: on disk read {size_text(r['disk_bytes_read'])}, written "
        f"{size_text(r['disk_bytes_written'])} in the last step ("
        + (
            f"{r['stored_ratio']:.2f}x smaller than the state"
            if r["stored_ratio"] is not None
            else f"it wrote nothing: {_why_no_io(r)}; the files hold what init and earlier steps wrote"
        )
        + "); "
        f"1000 such steps write {size_text(r['disk_bytes_written_per_1000_steps'])}"
    )
    if r["checkpoint"] is not None:
        c = r["checkpoint"]
        i = c["in_step"]
        print(
            f"checkpoint in the step by {i['mode']}: {i['step_seconds']:.2f} s against plain steps "
            f"{i['plain_step_seconds'][0]:.2f} / {i['plain_step_seconds'][1]:.2f} s ({i['ratio']:.2f}x, "
            f"{i['extra_seconds']:+.2f} s, of it publish {i['publish_seconds']:.2f} s); extra read "
            f"{size_text(i['extra_bytes_read'])}, extra written {size_text(i['extra_bytes_written'])}; "
            f"the step after it {i['step_after_ratio']:.2f}x the one before; its read-back "
            f"{size_text(i['verify_bytes_read'])} in {i['verify_seconds']:.2f} s"
        )
        print(
            f"checkpoint between steps ({c['save_kind']}) of {size_text(c['bytes'])}: {c['save_seconds']:.2f} s, "
            f"read {size_text(c['save_bytes_read'])}, written {size_text(c['save_bytes_written'])}; "
            f"with verify=True {c['save_verify_seconds']:.2f} s, read {size_text(c['save_verify_bytes_read'])}; "
            f"verified load {c['load_seconds']:.2f} s"
        )
    if r["state_dict"] is not None:
        for name, d in r["state_dict"].items():
            print(
                f"{name.replace('_', ' ')}: {d['seconds']:.2f} s, {size_text(d['bytes'])}, "
                f"{rate_text(d['bytes'] / d['seconds'])}; host RSS +{size_text(d['rss_growth_bytes'])} "
                f"(anonymous +{size_text(d['anon_growth_bytes'])}, budget staging + 1.1 GB = "
                f"{size_text((r['chunk_bytes'] + (1 << 30)))}), "
                f"page cache +{size_text(d['page_cache_growth_bytes'])}"
            )
    print(
        f"host RSS peak {size_text(r['host_rss_peak_bytes'])} (budget {size_text(r['host_rss_budget_bytes'])}: "
        f"before + staging + 1.1 GB; at init {size_text(r['init_host_rss_peak_bytes'])}), "
        f"page cache growth {size_text(r['page_cache_growth_bytes'])}"
    )
    print(
        "host RSS (anonymous) after: "
        + ", ".join(f"{name} {p['rss'] / GB:.2f} ({p['anon'] / GB:.2f}) GB" for name, p in r["host_rss_phases"].items())
    )
    if peer_failed is not None:
        raise peer_failed
    if r.get("against") is not None:
        from greenroom.cli.bench import peer

        peer.print_beside(r)
    return 0
