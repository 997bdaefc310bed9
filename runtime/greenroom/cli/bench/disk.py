"""``greenroom bench disk DIR``: the I/O layer's sequential bandwidth beside the raw disk.

Each of ``--repeat`` passes (default 3) measures both, back to back; the figures are the
min, median and max over the passes (one pass of this disk varies by 5x in write ratio).

The raw reference is plain O_DIRECT I/O from ``threads`` threads in ``block``-sized
requests (what fio would do), with no staging copy and no tensor in the way. Our figure
moves a tensor (on CUDA when available) through ``TransferEngine``, staging included.
Both keep the page cache out of the way, so the numbers are the disk's, not RAM's.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import mmap
import os
import statistics
import time
from dataclasses import asdict, dataclass

from greenroom.cli import flags as cliflags
from greenroom.config import check_disk_bytes, check_host_bytes
from greenroom.devices import check_device_bytes, resolve_device
from greenroom.dirs.rankdir import RankDir
from greenroom.dirs.roots import check_existing_root
from greenroom.errors import ConfigError
from greenroom.io import fs
from greenroom.io.compression import resolve as resolve_compression
from greenroom.io.engine import ALIGNMENT, DEFAULT_DEPTH, StateFile, TransferEngine, align_up
from greenroom.units import MIB, parse_bytes, positive_int

RAW_BLOCK = 64 * MIB
# --depth past this measures thread scheduling more than the disk (2 I/O threads per buffer).
MAX_DEPTH = 64
RAW_THREADS = 4
# The node probe's ceiling: 16 ranks' worth of threads, past what a node's ranks keep in flight.
MAX_RAW_THREADS = 64


@dataclass
class Bandwidth:
    write_bytes_per_s: float
    read_bytes_per_s: float
    o_direct: bool
    # With ``mixed``: each side's rate while half the threads read one half of the file
    # and the others write the other half (what a step that overlaps its reads and
    # write-backs can get from this disk); None when not probed.
    mixed_read_bytes_per_s: float | None = None
    mixed_write_bytes_per_s: float | None = None
    nbytes: int = 0
    """The bytes moved each way (the raw probe's file, in whole requests)."""
    first_write_bytes_per_s: float | None = None
    """The write into the file's fresh blocks, before ``write_bytes_per_s`` rewrites them
    (Note [backed blocks] in ``greenroom.io.statefile``); None when not probed."""


def raw_block(size: int) -> int:
    """The raw probe's request for ``size`` bytes: ``RAW_BLOCK``, or ``size`` in whole pages
    where that is less, so the probe moves the bytes it is set beside (one 64 MiB block
    for a 1 MiB --size made every ratio one of a 1 MiB transfer to a 64 MiB one)."""
    return min(RAW_BLOCK, align_up(size, ALIGNMENT))


def raw_bandwidth(
    directory: str, size: int, *, threads: int = RAW_THREADS, block: int | None = None, mixed: bool = False
) -> Bandwidth:
    """Plain positional I/O of ``size`` bytes into a scratch file in ``directory``, in
    ``block``-sized requests (default ``raw_block(size)``); with ``mixed`` (and two blocks
    or more), then reads and writes at once (``Bandwidth``).

    The file is written twice and the second write is the write rate: greenroom writes over
    blocks it has written before (a sleep's file is written once by ``Offloader.prepare``, a
    bucket file is rewritten in place each step), and a disk takes longer over a block's
    first write than over every later one (Note [backed blocks] in
    ``greenroom.io.statefile``; on an H100's virtual disk one rank's sleep wrote at 1.31x a
    probe of fresh blocks). The first write is kept as ``first_write_bytes_per_s``."""
    block = block or raw_block(size)
    size = align_up(size, block)
    direct = fs.supports_o_direct(directory)
    path = os.path.join(directory, f".greenroom-raw-{os.getpid()}")
    flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        offsets = list(range(0, size, block))
        buffers = [mmap.mmap(-1, block) for _ in range(threads)]  # page-aligned for O_DIRECT
        for b in buffers:
            # Incompressible bytes, like real state: a disk or virtual-disk host that
            # special-cases zero blocks would otherwise flatter the bound.
            b.write(os.urandom(block))

        def run(op, offsets=offsets, buffers=buffers) -> float:
            def worker(i: int) -> None:
                for off in offsets[i :: len(buffers)]:
                    op(buffers[i], off)

            start = time.perf_counter()
            with cf.ThreadPoolExecutor(len(buffers)) as pool:
                list(pool.map(worker, range(len(buffers))))
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return time.perf_counter() - start

        def write(buf, off) -> None:
            os.pwrite(fd, buf, off)

        def read(buf, off) -> None:
            os.preadv(fd, [buf], off)

        first = size / run(write)
        result = Bandwidth(size / run(write), size / run(read), direct, nbytes=size, first_write_bytes_per_s=first)
        if mixed and len(offsets) >= 2 and threads >= 2:
            half, side = len(offsets) // 2, threads // 2
            with cf.ThreadPoolExecutor(2) as sides:
                reading = sides.submit(run, read, offsets[:half], buffers[:side])
                writing = sides.submit(run, write, offsets[half:], buffers[side:])
                result.mixed_read_bytes_per_s = half * block / reading.result()
                result.mixed_write_bytes_per_s = (len(offsets) - half) * block / writing.result()
        for b in buffers:
            b.close()
        return result
    finally:
        os.close(fd)
        # Gone already where a SIGTERM's exit wiped the rank dir the probe ran in.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def node_bandwidth(directory: str, size_per_rank: int, ranks: int) -> Bandwidth:
    """The disk as ``ranks`` ranks of one node see it together: ``raw_bandwidth`` of
    ``ranks`` times the bytes with ``RAW_THREADS`` requests in flight per rank, mixed
    included (a streamed step reads and writes at once). One rank's engines keep 4-8
    requests in flight, and a disk that serves more at once (NVMe, a virtual disk) gives the
    node more than one rank's probe shows, so a node's figures come from a probe at its
    own concurrency (Note [node probe] in ``greenroom.cli.budget``)."""
    threads = min(RAW_THREADS * ranks, MAX_RAW_THREADS)
    # A rank's share in RAW_THREADS requests or more, so every thread has one and half
    # of them read while the others write.
    block = raw_block(max(size_per_rank // RAW_THREADS, ALIGNMENT))
    return raw_bandwidth(directory, align_up(size_per_rank, block) * ranks, threads=threads, block=block, mixed=True)


def engine_bandwidth(
    directory: str, size: int, *, chunk_bytes: int, depth: int, device: str, compression: str = "none"
) -> Bandwidth:
    """A ``size``-byte tensor on ``device`` written and read back through the I/O layer.
    Its bytes are random: with a ``compression`` codec nothing compresses, so this
    measures what the codec costs where it does not pay."""
    import torch

    codec = resolve_compression(compression, cuda=torch.device(device).type == "cuda", chunk_bytes=chunk_bytes).codec
    tensor = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
    back = torch.zeros_like(tensor)  # touched up front: page faults are not disk time
    path = os.path.join(directory, f".greenroom-engine-{os.getpid()}")
    try:
        with TransferEngine(chunk_bytes, depth=depth) as engine, StateFile(path, size, compression=codec) as f:
            # Once untimed: the raw probe's write rate is over blocks written before.
            engine.write(tensor, f, 0).wait()
            f.sync()
            start = time.perf_counter()
            engine.write(tensor, f, 0).wait()
            f.sync()
            write_s = time.perf_counter() - start
            start = time.perf_counter()
            engine.read(back, f, 0).wait()
            read_s = time.perf_counter() - start
            direct = f.direct
        assert torch.equal(tensor, back), "bench disk: data read back differs from data written"
        return Bandwidth(size / write_s, size / read_s, direct, nbytes=size)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    cliflags.disk_dir(parser, positional=True, help="a dir on the disk to measure (node-local NVMe)")
    parser.add_argument("--size", type=parse_bytes, default=1 << 30, help="bytes to move each way (default 1GiB)")
    cliflags.chunk_mb(parser, help="staging budget, MiB (default %(default)s)")
    parser.add_argument("--depth", type=int, default=DEFAULT_DEPTH, help="staging buffers / I/O threads")
    cliflags.device(parser)
    cliflags.compression(
        parser,
        help="also time the engine with this codec on the same random bytes (it cannot "
        "pay: the cost of trying); auto resolves as train does, none skips it",
    )
    parser.add_argument(
        "--repeat",
        type=positive_int,
        default=3,
        help="passes, each measuring raw and engine (default %(default)s); min/median/max reported",
    )
    cliflags.json_flag(parser)


def spread(values: list[float]) -> dict:
    """min, median, max of one figure over the passes."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def measure(directory: str, size: int, *, chunk_bytes: int, depth: int, device: str, compression: str = "none") -> dict:
    # The scratch files live in a rank dir of their own (locked, reclaimable after a crash).
    with RankDir(directory, role="bench-disk", allow_tmpfs=True) as rank_dir:
        raw = raw_bandwidth(rank_dir.path, size)
        ours = engine_bandwidth(rank_dir.path, size, chunk_bytes=chunk_bytes, depth=depth, device=device)
        coded = None
        if compression != "none":
            coded = asdict(
                engine_bandwidth(
                    rank_dir.path, size, chunk_bytes=chunk_bytes, depth=depth, device=device, compression=compression
                )
            )
            coded["write_vs_plain"] = coded["write_bytes_per_s"] / ours.write_bytes_per_s
            coded["read_vs_plain"] = coded["read_bytes_per_s"] / ours.read_bytes_per_s
    return {
        "compression": compression,
        "engine_compressed": coded,
        "dir": directory,
        "filesystem": fs.mount_of(directory).fstype,
        "size_bytes": size,
        "device": device,
        "chunk_bytes": chunk_bytes,
        "depth": depth,
        "raw": asdict(raw),
        "engine": asdict(ours),
        "write_ratio": ours.write_bytes_per_s / raw.write_bytes_per_s,
        "read_ratio": ours.read_bytes_per_s / raw.read_bytes_per_s,
    }


def measure_repeated(directory: str, size: int, *, repeat: int, **kwargs) -> dict:
    """``measure`` ``repeat`` times: every pass, and the spread of each figure."""
    passes = [measure(directory, size, **kwargs) for _ in range(repeat)]
    figures = {
        f"{side}_{way}_bytes_per_s": [p[side][f"{way}_bytes_per_s"] for p in passes]
        for side in ("raw", "engine")
        for way in ("write", "read")
    }
    figures.update({f"{way}_ratio": [p[f"{way}_ratio"] for p in passes] for way in ("write", "read")})
    result = dict(passes[-1])
    result.update(repeat=repeat, passes=passes, spread={k: spread(v) for k, v in figures.items()})
    # The headline figures are the medians (``raw``, ``engine``, the ratios).
    for side in ("raw", "engine"):
        medians = {
            f"{way}_bytes_per_s": result["spread"][f"{side}_{way}_bytes_per_s"]["median"] for way in ("write", "read")
        }
        result[side] = dict(result[side], **medians)
    for way in ("write", "read"):
        result[f"{way}_ratio"] = result["spread"][f"{way}_ratio"]["median"]
    return result


def run(args: argparse.Namespace) -> int:
    directory = cliflags.resolve_disk_dir(args, "bench disk")
    check_existing_root(directory, name="bench disk: DIR")
    if args.chunk_mb <= 0 or args.depth <= 0:
        raise ConfigError("bench disk: --offload-train-disk-chunk-mb and --depth must be positive integers")
    device = resolve_device(args.device, "bench disk")
    if args.compression == "auto":
        from greenroom.io.compression import resolve

        codec = resolve("auto", cuda=device == "cuda", chunk_bytes=args.chunk_mb * MIB).codec
        args.compression = codec.name if codec is not None else "none"
    # Each buffer holds whole frames of a codec (one MiB), or one aligned block at least.
    smallest, what = (MIB, "a compressed frame, 1 MiB,") if args.compression != "none" else (ALIGNMENT, "4 KiB")
    most = min(args.chunk_mb * MIB // smallest, MAX_DEPTH)
    if args.depth > most:
        raise ConfigError(
            f"bench disk --depth {args.depth}: use at most {most} (default {DEFAULT_DEPTH}): each buffer "
            f"holds at least {what} of the {args.chunk_mb} MiB of staging "
            f"(--offload-train-disk-chunk-mb), and past {MAX_DEPTH} buffers (2 I/O threads each) the "
            "bench measures threads more than the disk"
        )
    check_host_bytes("--offload-train-disk-chunk-mb", args.chunk_mb, args.chunk_mb * MIB)
    # One scratch file at a time (the raw probe's, then the engine's), and the tensor.
    check_disk_bytes(
        "bench disk --size", fs.human_bytes(args.size), align_up(args.size, raw_block(args.size)), directory
    )
    check_device_bytes("bench disk --size", fs.human_bytes(args.size), args.size, device, default="1GiB")
    result = measure_repeated(
        directory,
        args.size,
        repeat=args.repeat,
        chunk_bytes=args.chunk_mb * MIB,
        depth=args.depth,
        device=device,
        compression=args.compression,
    )
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    gb = 1e9
    print(
        f"bench disk {directory} ({result['filesystem']}), {args.size / gb:.2f} GB each way, "
        f"tensor on {device}, staging {args.chunk_mb} MiB in {args.depth} buffers, {args.repeat} pass(es): "
        "min / median / max"
    )
    print(f"{'':8}{'raw O_DIRECT GB/s':>24}{'greenroom GB/s':>24}{'ratio':>20}")
    spreads = result["spread"]

    def three(name: str, scale: float) -> str:
        s = spreads[name]
        return f"{s['min'] / scale:.2f} / {s['median'] / scale:.2f} / {s['max'] / scale:.2f}"

    for way in ("write", "read"):
        print(
            f"{way:8}{three(f'raw_{way}_bytes_per_s', gb):>24}{three(f'engine_{way}_bytes_per_s', gb):>24}"
            f"{three(f'{way}_ratio', 1):>20}"
        )
    if result["engine_compressed"] is not None:
        c = result["engine_compressed"]
        print(
            f"with --offload-train-disk-compression {args.compression} on incompressible bytes (last pass): write "
            f"{c['write_bytes_per_s'] / gb:.2f} GB/s ({c['write_vs_plain']:.2f} of plain), read "
            f"{c['read_bytes_per_s'] / gb:.2f} GB/s ({c['read_vs_plain']:.2f} of plain)"
        )
    return 0
