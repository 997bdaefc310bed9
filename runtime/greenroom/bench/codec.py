"""``greenroom bench codec``: the frame codec alone, against the disk it has to beat.

Encodes and decodes ``--size`` bytes of state in the engine's chunks of one-MiB frames,
through the same ``greenroom.compression`` calls the engine makes (device frames for
``nvcomp-ans``, host frames for ``zstd``), from ``--threads`` threads at once (the
engine's I/O threads), and prints each way's GB/s of raw bytes beside the raw disk
bandwidth probed in the same run, with the ratio the state compressed to. A codec slower
than the disk makes the mechanisms slower, not faster (docs/compression.md): this is the
figure that says how far the codec path is from paying.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from greenroom import cliflags, fs
from greenroom.bench.disk import MAX_DEPTH, RAW_BLOCK, raw_bandwidth
from greenroom.config import COMPRESSIONS, GB, MIB, check_device_bytes, check_disk_bytes
from greenroom.diskio import align_up
from greenroom.errors import ConfigError
from greenroom.rankdir import RankDir, check_root
from greenroom.units import parse_bytes

CHUNK = 64 * MIB  # one staging buffer of the default 256 MiB chunk
FRAME = MIB
MAX_THREADS = 2 * MAX_DEPTH


def configure_parser(parser: argparse.ArgumentParser) -> None:
    cliflags.compression(parser, default=None, choices=[c for c in COMPRESSIONS if c not in ("auto", "none")],
                         required=True, help="the codec to time")
    parser.add_argument("--size", type=parse_bytes, default=1 << 30, help="bytes of state (default 1GiB)")
    parser.add_argument("--state", choices=("trained", "random"), default="trained",
                        help="trained: fp32 masters of a transformer trained 50 steps (greenroom.bench.trained); "
                             "random: random bytes (nothing compresses)")
    parser.add_argument("--threads", type=int, default=4, help="threads calling the codec at once (default 4)")
    cliflags.disk_dir(parser, help="also probe the raw disk here, for the ratio to it")
    cliflags.json_flag(parser)


def measure(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    from greenroom import compression

    cuda = torch.cuda.is_available()
    codec, _ = compression.resolve(args.compression, cuda=cuda, chunk_bytes=4 * CHUNK)
    device = torch.device("cuda" if codec.on_device else "cpu")
    n = args.size // CHUNK * CHUNK or CHUNK
    # The state and its payloads (at most as large: a frame that does not shrink is kept raw).
    check_device_bytes("bench codec --size", fs.human_bytes(args.size), 2 * n, device, default="1GiB",
                       counted="the state and its coded frames")
    if args.dir:
        check_disk_bytes("bench codec --size", fs.human_bytes(args.size), align_up(min(n, 1 << 30), RAW_BLOCK),
                         args.dir, counted="the raw probe's file")
    if args.state == "trained":
        from greenroom.bench.trained import train

        data = train(device).tiled("master", n // 4, torch.float32).view(torch.uint8)
    else:
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    chunks = data.view(-1, CHUNK)
    stored = [0]
    lock = threading.Lock()

    def run_chunks(worker: int, decode: bool) -> None:
        stream = torch.cuda.Stream(device) if codec.on_device else None
        for k in range(worker, chunks.shape[0], args.threads):
            frames = list(chunks[k].view(-1, FRAME))
            if codec.on_device:
                coded = codec.encode(frames, [4] * len(frames), stream)
                layouts, payloads = [(codec_id, 4) for codec_id, _ in coded], [p for _, p in coded]
                if decode:
                    outs = [torch.empty(FRAME, dtype=torch.uint8, device=device) for _ in payloads]
                    # As the engine decodes: the payloads back to back in one buffer (at the
                    # codec's alignment, as a chunk stores them after their headers).
                    spans, at = [], 0
                    for p in payloads:
                        spans.append((at, p.numel()))
                        at += -(-p.numel() // 256) * 256
                    with torch.cuda.stream(stream):
                        packed = torch.empty(at, dtype=torch.uint8, device=device)
                        for (start, n), p in zip(spans, payloads):
                            packed[start:start + n].copy_(p)
                    codec.decode(packed, spans, outs, layouts, stream, ["bench"] * len(frames))
                size = sum(p.numel() for p in payloads)
            else:
                payloads = [codec.encode(f.numpy(), 4) for f in frames]
                if decode:
                    out = np.empty(FRAME, dtype=np.uint8)
                    for p in payloads:
                        codec.decode(memoryview(p), out, 4, "bench")
                size = sum(len(p) for p in payloads)
            if not decode:
                with lock:
                    stored[0] += size

    def timed(decode: bool) -> float:
        workers = [threading.Thread(target=run_chunks, args=(w, decode)) for w in range(args.threads)]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - start

    timed(False)  # warm-up: codec contexts, allocator pools
    stored[0] = 0
    encode_s = timed(False)
    both_s = timed(True)
    decode_s = max(both_s - encode_s, 1e-9)  # the decode pass re-encodes to have payloads
    result = {"compression": args.compression, "state": args.state, "bytes": n, "threads": args.threads,
              "device": str(device), "ratio": n / max(stored[0], 1),
              "encode_bytes_per_s": n / encode_s, "decode_bytes_per_s": n / decode_s}
    if args.dir:
        with RankDir(args.dir, role="bench-codec", allow_tmpfs=True) as rank_dir:
            raw = raw_bandwidth(rank_dir.path, min(n, 1 << 30))
        result.update(raw_write_bytes_per_s=raw.write_bytes_per_s, raw_read_bytes_per_s=raw.read_bytes_per_s,
                      encode_vs_disk=result["encode_bytes_per_s"] / raw.write_bytes_per_s,
                      decode_vs_disk=result["decode_bytes_per_s"] / raw.read_bytes_per_s)
    return result


def run(args: argparse.Namespace) -> int:
    if not 0 < args.threads <= MAX_THREADS:
        raise ConfigError(f"bench codec --threads: expected 1 to {MAX_THREADS} (the engine runs 2 per staging "
                          f"buffer), got {args.threads}")
    if args.dir:
        check_root(args.dir, name="bench codec --dir")
    r = measure(args)
    if args.json:
        print(json.dumps(r, sort_keys=True))
        return 0
    print(f"bench codec {r['compression']} on {r['device']}, {r['bytes'] / GB:.2f} GB of {r['state']} state in "
          f"1 MiB frames, {r['threads']} thread(s): ratio {r['ratio']:.3f}")
    line = f"encode {r['encode_bytes_per_s'] / GB:.2f} GB/s, decode {r['decode_bytes_per_s'] / GB:.2f} GB/s"
    if "raw_write_bytes_per_s" in r:
        line += (f"; raw disk write {r['raw_write_bytes_per_s'] / GB:.2f} GB/s ({r['encode_vs_disk']:.2f}x), "
                 f"read {r['raw_read_bytes_per_s'] / GB:.2f} GB/s ({r['decode_vs_disk']:.2f}x)")
    print(line)
    return 0
