"""``greenroom bench codec``: the frame codec alone, against the disk it has to beat.

Encodes and decodes ``--size`` bytes of state in the engine's chunks of one-MiB frames,
through the same ``greenroom.io.compression`` calls the engine makes (device frames for
``nvcomp-ans``, host frames for ``zstd``), from ``--threads`` threads at once (the
engine's I/O threads), and prints each way's GB/s of raw bytes beside the raw disk
bandwidth probed in the same run, with the ratio the state compressed to. A codec slower
than the disk makes the mechanisms slower, not faster (docs/compression.md): this is the
figure that says how far the codec path is from paying.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

from greenroom.cli import flags as cliflags
from greenroom.cli.bench.disk import MAX_DEPTH, RAW_BLOCK, raw_bandwidth
from greenroom.config import check_disk_bytes
from greenroom.devices import check_device_bytes
from greenroom.dirs.rankdir import RankDir
from greenroom.dirs.roots import check_existing_root
from greenroom.errors import ConfigError
from greenroom.io import fs
from greenroom.io.codec_names import CODECS as COMPRESSIONS
from greenroom.io.engine import align_up
from greenroom.units import MIB, parse_bytes, rate_text, size_text

CHUNK = 64 * MIB  # one staging buffer of the default 256 MiB chunk
FRAME = MIB
MAX_THREADS = 2 * MAX_DEPTH


def configure_parser(parser: argparse.ArgumentParser) -> None:
    cliflags.compression(
        parser,
        default=None,
        choices=[c for c in COMPRESSIONS if c not in ("auto", "none")],
        required=True,
        help="the codec to time",
    )
    parser.add_argument(
        "--size",
        type=parse_bytes,
        default=1 << 30,
        help="bytes of state, in whole 64 MiB chunks: rounded down, at least one (default 1GiB; the "
        "report gives the size timed)",
    )
    parser.add_argument(
        "--state",
        choices=("trained", "random"),
        default="trained",
        help="trained: fp32 masters of a transformer trained 50 steps (greenroom.cli.bench.trained); "
        "random: random bytes (nothing compresses)",
    )
    parser.add_argument("--threads", type=int, default=4, help="threads calling the codec at once (default 4)")
    cliflags.disk_dir(parser, positional=True, help="also probe the raw disk here, for the ratio to it")
    cliflags.json_flag(parser)


def measure(args: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    from greenroom.io import compression

    cuda = torch.cuda.is_available()
    codec = compression.resolve(args.compression, cuda=cuda, chunk_bytes=4 * CHUNK).codec
    device = torch.device("cuda" if codec.on_device else "cpu")
    n = args.size // CHUNK * CHUNK or CHUNK
    # The state, its stored chunks (at most as large: a frame that does not shrink is kept
    # raw) and each thread's decoded chunk.
    check_device_bytes(
        "bench codec --size",
        fs.human_bytes(args.size),
        2 * n + args.threads * CHUNK,
        device,
        default="1GiB",
        counted="the state, its coded frames and the decoded chunks",
    )
    if args.dir:
        check_disk_bytes(
            "bench codec --size",
            fs.human_bytes(args.size),
            align_up(min(n, 1 << 30), RAW_BLOCK),
            args.dir,
            counted="the raw probe's file",
        )
    if args.state == "trained":
        from greenroom.cli.bench.trained import train

        data = train(device).tiled("master", n // 4, torch.float32).view(torch.uint8)
    else:
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    chunks = data.view(-1, CHUNK)
    streams = [torch.cuda.Stream(device) if codec.on_device else None for _ in range(args.threads)]
    stored: dict[int, object] = {}  # chunk -> its payloads, as the engine's write leaves them

    def encode(worker: int, k: int, _state) -> None:
        frames = list(chunks[k].view(-1, FRAME))
        if codec.on_device:
            stored[k] = codec.encode(frames, [4] * len(frames), streams[worker])
        else:
            stored[k] = [codec.encode(f.numpy(), 4) for f in frames]

    def pack(k: int) -> None:
        # As the engine reads a chunk: its payloads back to back in one device buffer (at the
        # codec's alignment, as a chunk stores them after their headers), each decoded from
        # its offset there. Untimed: the engine's one copy of the run is the disk's side.
        coded, spans, at = stored[k], [], 0
        for _, payload in coded:
            spans.append((at, payload.numel()))
            at += -(-payload.numel() // 256) * 256
        packed = torch.empty(at, dtype=torch.uint8, device=device)
        for (start, size), (_, payload) in zip(spans, coded):
            packed[start : start + size].copy_(payload)
        stored[k] = (packed, spans, [(codec_id, 4) for codec_id, _ in coded])

    def decode(worker: int, k: int, state) -> None:
        out, decoders = state
        if codec.on_device:
            packed, spans, layouts = stored[k]
            codec.decode(
                packed,
                spans,
                list(out.view(-1, FRAME)),
                layouts,
                streams[worker],
                ["bench"] * len(spans),
                decoders=decoders,
            )
        else:
            for payload, frame_out in zip(stored[k], out.reshape(-1, FRAME)):
                codec.decode(memoryview(payload), frame_out, 4, "bench")

    def new_state(kept: bool):
        out = (
            torch.empty(CHUNK, dtype=torch.uint8, device=device) if codec.on_device else np.empty(CHUNK, dtype=np.uint8)
        )
        return out, ({} if kept else None)

    def timed(work, states=None, chunk_list=None) -> float:
        """Seconds for ``--threads`` threads to run ``work`` over the chunks, each thread
        every ``--threads``-th one (the engine hands chunks to its I/O threads in turn);
        ``states``: each thread's, kept from call to call (default: new ones)."""
        todo = range(chunks.shape[0]) if chunk_list is None else chunk_list

        def thread(worker: int) -> None:
            state = new_state(False) if states is None else states[worker]
            for k in todo[worker :: args.threads]:
                work(worker, k, state)

        start = time.perf_counter()
        with ThreadPoolExecutor(args.threads) as pool:
            for done in [pool.submit(thread, w) for w in range(args.threads)]:
                done.result()  # a thread's error is the bench's
        return time.perf_counter() - start

    timed(encode)  # warm-up: codec contexts, allocator pools
    encode_s = timed(encode)
    if codec.on_device:
        stored_bytes = sum(payload.numel() for coded in stored.values() for _, payload in coded)
        for k in range(chunks.shape[0]):
            pack(k)
        torch.cuda.synchronize(device)
    else:
        stored_bytes = sum(len(payload) for coded in stored.values() for payload in coded)
    warm_up = range(min(args.threads, chunks.shape[0]))
    timed(decode, chunk_list=warm_up)  # warm-up of the decode path
    decode_s = timed(decode)
    result = {
        "compression": args.compression,
        "state": args.state,
        "bytes": n,
        "threads": args.threads,
        "device": str(device),
        "ratio": n / max(stored_bytes, 1),
        "encode_bytes_per_s": n / encode_s,
        "decode_bytes_per_s": n / decode_s,
    }
    if codec.on_device:
        # The same chunks with each thread's nvCOMP decoders kept from chunk to chunk, as the
        # engine keeps them (Note [kept decoders] of greenroom.io.kept_decoders), made in a warm-up
        # first: a decoder's construction timed in the pass would cost the one-thread
        # figure half its rate.
        kept = [new_state(True) for _ in range(args.threads)]
        timed(decode, states=kept, chunk_list=warm_up)
        result["decode_kept_bytes_per_s"] = n / timed(decode, states=kept)
    result["bit_exact"] = _round_trips(chunks, stored, decode, new_state)
    if args.dir:
        with RankDir(args.dir, role="bench-codec", allow_tmpfs=True) as rank_dir:
            raw = raw_bandwidth(rank_dir.path, min(n, 1 << 30))
        result.update(
            raw_write_bytes_per_s=raw.write_bytes_per_s,
            raw_read_bytes_per_s=raw.read_bytes_per_s,
            encode_vs_disk=result["encode_bytes_per_s"] / raw.write_bytes_per_s,
            decode_vs_disk=result["decode_bytes_per_s"] / raw.read_bytes_per_s,
        )
    return result


def _round_trips(chunks, stored, decode, new_state) -> bool:
    """Whether every chunk decodes to its state, bit for bit (untimed, one thread)."""
    import torch

    state = new_state(False)
    for k in range(chunks.shape[0]):
        decode(0, k, state)
        out = torch.as_tensor(state[0])
        if not torch.equal(out, chunks[k]):
            return False
    return True


def run(args: argparse.Namespace) -> int:
    if not 0 < args.threads <= MAX_THREADS:
        raise ConfigError(
            f"bench codec --threads: expected 1 to {MAX_THREADS} (the engine runs 2 per staging "
            f"buffer), got {args.threads}"
        )
    if cliflags.resolve_disk_dir(args, "bench codec", required=False):
        check_existing_root(args.dir, name="bench codec --dir")
    r = measure(args)
    if args.json:
        print(json.dumps(r, sort_keys=True))
        return 0 if r["bit_exact"] else 1
    print(
        f"bench codec {r['compression']} on {r['device']}, {size_text(r['bytes'])} of {r['state']} state in "
        f"1 MiB frames, {r['threads']} thread(s): ratio {r['ratio']:.3f}, bit-exact: {r['bit_exact']}"
    )
    line = f"encode {rate_text(r['encode_bytes_per_s'])}, decode {rate_text(r['decode_bytes_per_s'])}"
    if "decode_kept_bytes_per_s" in r:
        line += f" ({rate_text(r['decode_kept_bytes_per_s'])} with decoders kept)"
    if "raw_write_bytes_per_s" in r:
        line += (
            f"; raw disk write {rate_text(r['raw_write_bytes_per_s'])} ({r['encode_vs_disk']:.2f}x), "
            f"read {rate_text(r['raw_read_bytes_per_s'])} ({r['decode_vs_disk']:.2f}x)"
        )
    print(line)
    return 0 if r["bit_exact"] else 1
