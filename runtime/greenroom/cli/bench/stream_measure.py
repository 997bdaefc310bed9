"""The timed run of ``greenroom bench stream`` (``greenroom.cli.bench.stream``): the
optimizer built on the bench's params, its steps timed beside two raw disk probes, and,
when asked, a checkpoint and a state dict timed after them. ``measure`` returns every
figure as one dict: what ``--json`` prints and ``stream_report`` writes out.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
import warnings
from collections.abc import Callable

import psutil

from greenroom.actor.memory import RssSampler
from greenroom.cli.bench import explain
from greenroom.io import fs
from greenroom.io.timeline import Timeline
from greenroom.optim.footprint import streamed_bytes_per_param
from greenroom.units import GB, MIB


def measure(args: argparse.Namespace, *, rank: int = 0, barrier: Callable[[], None] | None = None) -> dict:
    """The run of ``args`` in the rank dir of ``rank``; ``barrier``, where given, is
    called before each timed step and after the last (``greenroom bench node``: ranks
    sharing one disk time their steps together, and no rank's probe lands in another's step)."""
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

    sync = barrier or (lambda: None)
    with RankDir(args.dir, role="bench-stream", rank=rank, allow_tmpfs=args.allow_tmpfs) as rank_dir:
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
        timeline = Timeline()  # where each step's time goes (greenroom.io.timeline)
        opt.store.engine.record(timeline)
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
                    sync()
                    timeline.clear()
                    start, cpu_start = time.perf_counter(), time.process_time()
                    opt.step()
                    allocated()
                    seconds = time.perf_counter() - start
                    steps.append(
                        {
                            "seconds": seconds,
                            "breakdown": timeline.summary(start, start + seconds),
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
                sync()
            rss_phases["steps"] = _rss_now()
            opt.store.engine.record(None)  # the steps only
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
    explain.judge_steps(steps, raw.mixed_read_bytes_per_s, raw.mixed_write_bytes_per_s)
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
        "raw_first_write_bytes_per_s": raw.first_write_bytes_per_s,
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
