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
- per step, where its time went (``breakdown``, ``greenroom.io.timeline``): the disk's busy
  fraction and the disk's idle time split between the codec, device copies, host work,
  waits on transfers and the rest; its own ``overlapped_ratio``, and, where that is over
  1.05, the ``explanation`` that names the largest share (``greenroom.cli.bench.explain``);
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

This module holds the flags, their checks and the command; the timed run is
``stream_measure``, the text report ``stream_report``.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from greenroom.cli import flags as cliflags
from greenroom.cli.bench.stream_measure import measure
from greenroom.cli.bench.stream_report import print_text
from greenroom.config import check_disk_bytes, check_host_bytes
from greenroom.devices import check_device_bytes, resolve_device
from greenroom.dirs.roots import check_existing_root
from greenroom.errors import ConfigError, GreenroomError
from greenroom.io import fs
from greenroom.optim.footprint import streamed_bytes_per_param
from greenroom.optim.store.bucket_store import DEFAULT_BUCKET_NUMEL
from greenroom.units import GB, MIB, parse_bytes, parse_count

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
    print_text(result)
    if peer_failed is not None:
        raise peer_failed
    if result.get("against") is not None:
        from greenroom.cli.bench import peer

        peer.print_beside(result)
    return 0
