"""Peak HBM and timing of megatron's DistributedOptimizer with and without streaming.

    python -m greenroom.cli.bench.megatron --mode stock|stream --hidden 2048 --layers 16 \
        --dir /root/gr --steps 2 [--offload] [--json]

One mode per process, so each starts from an empty CUDA allocator. Prints the peak HBM
while the optimizer is built (above what the model and its DDP buffers hold), the peak
HBM during ``optimizer.step()`` (absolute, and above what was allocated when it began),
step seconds, and with ``--offload`` the actor's sleep/wake seconds to disk through
``greenroom.actor`` (portable backend) with the optimizer's resident state tracked.

``--checkpoint KINDS`` then saves the model and optimizer once per sharding type named
(comma-separated: ``fully_reshardable``, ``dp_reshardable``, ``greenroom_streamed``, the
sidecar format, whose bucket files ``greenroom.megatron.save_checkpoint`` writes beside
it; stream mode only) through ``dist_checkpointing.save``, synchronously, into a dir of
its own under ``--dir`` that it removes after: each save's seconds, the bytes the process
read from and wrote to storage meanwhile (``/proc/self/io``, every thread), the
largest growth of its anonymous host memory meanwhile (``host_memory.PeakAnon``: a copy
of the state would show here; the maps' page cache does not) and the checkpoint's size;
the seconds split into the state dict's build (where a stock format
freezes each bucket: a link and a read against its checksums, or, for a bucket stored in
frames or narrow moments, a decode into an fp32 file of its own, ``megatron.staging``) and
megatron's write, with the count of buckets each way. ``--decode-in-save`` saves the
stock formats through ``greenroom.megatron.StreamedSaveStrategy``, which leaves such a
bucket to the write, decoded once into the checkpoint (staging Note [decode in the save]).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch

from greenroom import config as gconfig
from greenroom.cli import flags as cliflags
from greenroom.cli.bench.host_memory import PeakAnon
from greenroom.megatron import demo
from greenroom.units import GIB


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=("stock", "stream"), required=True)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=2)
    cliflags.disk_dir(parser, required=True, help="disk dir for the bucket files and the offload files")
    cliflags.moment_dtype(parser)
    cliflags.compression(parser, help="lossless codec of the bucket files and the offload files")
    parser.add_argument("--offload", action="store_true", help="also time a sleep/wake cycle to disk")
    parser.add_argument(
        "--checkpoint",
        type=_kinds,
        default=(),
        metavar="KINDS",
        help=f"after the steps, time one save per sharding type ({', '.join(CHECKPOINT_KINDS)}; comma-separated)",
    )
    parser.add_argument(
        "--decode-in-save",
        action="store_true",
        help="save the stock formats through greenroom.megatron.StreamedSaveStrategy (stream mode)",
    )
    cliflags.json_flag(parser)


CHECKPOINT_KINDS = ("fully_reshardable", "dp_reshardable", "greenroom_streamed")


def _kinds(value: str) -> tuple[str, ...]:
    kinds = tuple(k for k in value.split(",") if k)
    bad = [k for k in kinds if k not in CHECKPOINT_KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(CHECKPOINT_KINDS)}, got {value!r}")
    return kinds


def _gib(n: int) -> float:
    return round(n / GIB, 3)


def run(args) -> int:
    from megatron.core.optimizer import get_megatron_optimizer

    from greenroom.dirs.rankdir import RankDir
    from greenroom.megatron import close, streaming, streaming_members

    demo.init_single_gpu()
    size = demo.ModelSize(
        hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=args.vocab, seq=args.seq, batch=1
    )
    offload = gconfig.OffloadConfig(
        offload_train=args.offload,
        offload_train_target="disk" if args.offload else None,
        offload_train_disk_dir=args.dir,
        stream_optimizer_state_to_disk=args.mode == "stream",
        stream_optimizer_state_moment_dtype=args.moment_dtype,
        offload_train_disk_compression=args.compression,
    )
    with RankDir(args.dir, role=f"bench-{args.mode}") as rank_dir:
        model = demo.build_model(size)
        params = sum(p.numel() for p in model.parameters())
        torch.cuda.synchronize()
        before_init = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        if args.mode == "stream":
            with streaming(offload, rank_dir):
                optimizer = get_megatron_optimizer(demo.optimizer_config(), [model])
        else:
            optimizer = get_megatron_optimizer(demo.optimizer_config(), [model])
        torch.cuda.synchronize()
        init_seconds = time.perf_counter() - t0
        result = {
            "mode": args.mode,
            "params": params,
            "moment_dtype": args.moment_dtype,
            "compression": args.compression,
            "init_seconds": round(init_seconds, 3),
            "init_peak_above_model_gib": _gib(torch.cuda.max_memory_allocated() - before_init),
            "after_init_above_model_gib": _gib(torch.cuda.memory_allocated() - before_init),
        }
        if args.mode == "stream":
            member = streaming_members(optimizer)[0]
            result["largest_shard_fp32_gib"] = _gib(4 * max(e.numel for e in member.shard_entries))
            result["buckets"] = len(member.store.buckets)
            result["bucket_file_gib"] = _gib(member.store.max_bucket_bytes)
        steps = []
        for step in range(args.steps):
            # A hook times the optimizer step alone, after forward and backward.
            steps.append(_timed_step(model, optimizer, size, step))
        result["step_seconds"] = [s["seconds"] for s in steps]
        result["step_peak_gib"] = max(s["peak"] for s in steps)
        result["step_peak_above_start_gib"] = max(s["above"] for s in steps)
        result["allocated_at_step_start_gib"] = steps[-1]["start"]
        if args.checkpoint:
            streamed = args.mode == "stream"
            saves = [
                _timed_save(args.dir, k, model, optimizer, streamed=streamed, decode_in_save=args.decode_in_save)
                for k in args.checkpoint
            ]
            result["checkpoints"] = saves
        if args.offload:
            result.update(_sleep_wake(offload, rank_dir, model, optimizer, args.mode))
        if args.mode == "stream":
            close(optimizer)
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return 0


def _timed_step(model, optimizer, size, step) -> dict:
    real_step = optimizer.step
    record = {}

    def timed():
        torch.cuda.synchronize()
        record["start"] = _gib(torch.cuda.memory_allocated())
        start_bytes = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = real_step()
        torch.cuda.synchronize()
        record["seconds"] = round(time.perf_counter() - t0, 3)
        record["peak"] = _gib(torch.cuda.max_memory_allocated())
        record["above"] = _gib(torch.cuda.max_memory_allocated() - start_bytes)
        return out

    optimizer.step = timed
    try:
        demo.train_step(model, optimizer, size, step)
    finally:
        del optimizer.step
    return record


def _storage_io() -> tuple[int, int]:
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def _timed_save(root: str, kind: str, model, optimizer, *, streamed: bool, decode_in_save: bool = False) -> dict:
    from megatron.core import dist_checkpointing

    from greenroom.megatron import DECODE_IN_SAVE, StreamedSaveStrategy, dist_ckpt, save_checkpoint, streaming_members

    decode_in_save = decode_in_save and kind != "greenroom_streamed"

    path = os.path.join(root, f"bench-checkpoint-{kind}-{os.getpid()}")
    os.makedirs(path)
    try:
        torch.cuda.synchronize()
        read0, written0 = _storage_io()
        with PeakAnon() as memory:
            t0 = time.perf_counter()
            model_sd = model.module.sharded_state_dict()
            metadata = {"distrib_optim_sharding_type": kind, DECODE_IN_SAVE: decode_in_save}
            state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, metadata=metadata)}
            t1 = time.perf_counter()
            dist_checkpointing.save(state, path, sharded_strategy=StreamedSaveStrategy() if decode_in_save else None)
            if kind == "greenroom_streamed":
                save_checkpoint(optimizer, path)
            t2 = time.perf_counter()
        read1, written1 = _storage_io()
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
        record = {
            "kind": kind,
            "decode_in_save": decode_in_save,
            "seconds": round(t2 - t0, 3),
            "state_dict_seconds": round(t1 - t0, 3),
            "write_seconds": round(t2 - t1, 3),
            "bytes_read": read1 - read0,
            "bytes_written": written1 - written0,
            "peak_anon_bytes": memory.peak,
            "checkpoint_bytes": size,
        }
        # The sidecar format freezes nothing: a stock save's maps may still be held from before.
        members = streaming_members(optimizer) if streamed and kind != "greenroom_streamed" else []
        ways = [w for w in map(dist_ckpt.save_ways, members) if w is not None]
        if ways:  # how a stock format's state dict froze each bucket (``megatron.staging``)
            record["buckets_by"] = {w: sum(d[w] for d in ways) for w in ways[0]}
        return record
    finally:
        shutil.rmtree(path)


def _sleep_wake(offload, rank_dir, model, optimizer, mode) -> dict:
    from greenroom.actor import build_offloader

    # megatron's DDP shadows Module.buffers with its list of param-and-grad buffers:
    # track the wrapped module's params (views of the param buffer) and the grad buffers.
    sources = [model.module, [b.grad_data for b in model.buffers]]
    for member in getattr(optimizer, "chained_optimizers", [optimizer]):
        if mode == "stream":
            member.release_device_memory()  # the bucket buffers: the files hold what they held
            if member.resident_optimizer is not None:
                sources.append(member.resident_optimizer)
        else:
            sources.append(member.optimizer)
            sources.append([m for group in member.shard_fp32_from_float16_groups for m in group])
    offloader = build_offloader(offload, rank_dir, device="cuda", backend="portable")
    offloader.track(*sources)
    tracked_bytes = offloader.resident_bytes()
    sleep = offloader.sleep()
    asleep_allocated = torch.cuda.memory_allocated()
    wake = offloader.wake()
    offloader.close()
    return {
        "offload_bytes_gib": _gib(tracked_bytes),
        "sleep_seconds": round(sleep.seconds, 3),
        "wake_seconds": round(wake.seconds, 3),
        "allocated_asleep_gib": _gib(asleep_allocated),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m greenroom.cli.bench.megatron", description=__doc__.splitlines()[0])
    configure_parser(parser)
    args = parser.parse_args(argv)
    if args.mode == "stock" and "greenroom_streamed" in args.checkpoint:
        parser.error("--checkpoint greenroom_streamed: the sidecar format is the streaming optimizer's (--mode stream)")
    if args.decode_in_save and args.mode == "stock":
        parser.error("--decode-in-save: the streaming optimizer's (--mode stream)")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
