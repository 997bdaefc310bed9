"""``greenroom bench disk DIR``: the I/O layer's sequential bandwidth beside the raw disk.

The raw reference is plain O_DIRECT I/O from ``threads`` threads in ``block``-sized
requests (what fio would do), with no staging copy and no tensor in the way. Our figure
moves a tensor (on CUDA when available) through ``TransferEngine``, staging included.
Both keep the page cache out of the way, so the numbers are the disk's, not RAM's.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import mmap
import os
import time
from dataclasses import asdict, dataclass

from greenroom import fs
from greenroom.compression import resolve as resolve_compression
from greenroom.config import COMPRESSIONS, DEFAULT_CHUNK_MB, MIB, check_host_bytes
from greenroom.diskio import DEFAULT_DEPTH, StateFile, TransferEngine, align_up
from greenroom.errors import ConfigError
from greenroom.rankdir import RankDir, check_root

RAW_BLOCK = 64 * MIB
RAW_THREADS = 4


@dataclass
class Bandwidth:
    write_bytes_per_s: float
    read_bytes_per_s: float
    o_direct: bool


def _parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            value = int(float(t[:-1]) * units[t[-1]])
        else:
            value = int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--size: {text!r} is not a size (e.g. 4GiB, 512MiB, 1000000)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--size must be positive, got {text!r}")
    return value


def raw_bandwidth(directory: str, size: int, *, threads: int = RAW_THREADS, block: int = RAW_BLOCK) -> Bandwidth:
    """Plain positional I/O of ``size`` bytes into a scratch file in ``directory``."""
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

        def run(op) -> float:
            def worker(i: int) -> None:
                for off in offsets[i::threads]:
                    op(buffers[i], off)
            start = time.perf_counter()
            with cf.ThreadPoolExecutor(threads) as pool:
                list(pool.map(worker, range(threads)))
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return time.perf_counter() - start

        write_s = run(lambda buf, off: os.pwrite(fd, buf, off))
        read_s = run(lambda buf, off: os.preadv(fd, [buf], off))
        for b in buffers:
            b.close()
        return Bandwidth(size / write_s, size / read_s, direct)
    finally:
        os.close(fd)
        os.unlink(path)


def engine_bandwidth(directory: str, size: int, *, chunk_bytes: int, depth: int, device: str,
                     compression: str = "none") -> Bandwidth:
    """A ``size``-byte tensor on ``device`` written and read back through the I/O layer.
    Its bytes are random: with a ``compression`` codec nothing compresses, so this
    measures what the codec costs where it does not pay."""
    import torch

    codec, _ = resolve_compression(compression, cuda=torch.device(device).type == "cuda", chunk_bytes=chunk_bytes)
    tensor = torch.randint(0, 256, (size,), dtype=torch.uint8, device=device)
    back = torch.zeros_like(tensor)  # touched up front: page faults are not disk time
    path = os.path.join(directory, f".greenroom-engine-{os.getpid()}")
    try:
        with TransferEngine(chunk_bytes, depth=depth) as engine, StateFile(path, size, compression=codec) as f:
            start = time.perf_counter()
            engine.write(tensor, f, 0).wait()
            f.sync()
            write_s = time.perf_counter() - start
            start = time.perf_counter()
            engine.read(back, f, 0).wait()
            read_s = time.perf_counter() - start
            direct = f.direct
        assert torch.equal(tensor, back), "bench disk: data read back differs from data written"
        return Bandwidth(size / write_s, size / read_s, direct)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="a dir on the disk to measure (node-local NVMe)")
    parser.add_argument("--size", type=_parse_size, default=1 << 30, help="bytes to move each way (default 1GiB)")
    parser.add_argument("--chunk-mb", type=int, default=DEFAULT_CHUNK_MB, help="staging budget, MiB")
    parser.add_argument("--depth", type=int, default=DEFAULT_DEPTH, help="staging buffers / I/O threads")
    parser.add_argument("--device", default=None, help="tensor device (default cuda when available, else cpu)")
    parser.add_argument("--compression", choices=COMPRESSIONS, default="none",
                        help="also time the engine with this codec on the same random bytes (it cannot pay: the "
                             "cost of trying)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def measure(directory: str, size: int, *, chunk_bytes: int, depth: int, device: str,
            compression: str = "none") -> dict:
    # The scratch files live in a rank dir of their own (locked, reclaimable after a crash).
    with RankDir(directory, role="bench-disk", allow_tmpfs=True) as rank_dir:
        raw = raw_bandwidth(rank_dir.path, size)
        ours = engine_bandwidth(rank_dir.path, size, chunk_bytes=chunk_bytes, depth=depth, device=device)
        coded = None
        if compression != "none":
            coded = asdict(engine_bandwidth(rank_dir.path, size, chunk_bytes=chunk_bytes, depth=depth, device=device,
                                            compression=compression))
            coded["write_vs_plain"] = coded["write_bytes_per_s"] / ours.write_bytes_per_s
            coded["read_vs_plain"] = coded["read_bytes_per_s"] / ours.read_bytes_per_s
    return {
        "compression": compression, "engine_compressed": coded,
        "dir": directory, "filesystem": fs.mount_of(directory).fstype, "size_bytes": size, "device": device,
        "chunk_bytes": chunk_bytes, "depth": depth,
        "raw": asdict(raw), "engine": asdict(ours),
        "write_ratio": ours.write_bytes_per_s / raw.write_bytes_per_s,
        "read_ratio": ours.read_bytes_per_s / raw.read_bytes_per_s,
    }


def run(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.dir):
        raise ConfigError(f"bench disk: DIR {args.dir} is not a directory")
    check_root(args.dir, name="bench disk: DIR")
    if args.chunk_mb <= 0 or args.depth <= 0:
        raise ConfigError("bench disk: --chunk-mb and --depth must be positive integers")
    check_host_bytes("--chunk-mb", args.chunk_mb, args.chunk_mb * MIB)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    result = measure(args.dir, args.size, chunk_bytes=args.chunk_mb * MIB, depth=args.depth, device=device,
                     compression=args.compression)
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    gb = 1e9
    print(f"bench disk {args.dir} ({result['filesystem']}), {args.size / gb:.2f} GB each way, "
          f"tensor on {device}, staging {args.chunk_mb} MiB in {args.depth} buffers")
    print(f"{'':8}{'raw O_DIRECT':>14}{'greenroom':>12}{'ratio':>8}")
    for way in ("write", "read"):
        raw_bw = result["raw"][f"{way}_bytes_per_s"] / gb
        our_bw = result["engine"][f"{way}_bytes_per_s"] / gb
        print(f"{way:8}{raw_bw:>10.2f} GB/s{our_bw:>7.2f} GB/s{result[f'{way}_ratio']:>8.2f}")
    if result["engine_compressed"] is not None:
        c = result["engine_compressed"]
        print(f"with --compression {args.compression} on incompressible bytes: write "
              f"{c['write_bytes_per_s'] / gb:.2f} GB/s ({c['write_vs_plain']:.2f} of plain), read "
              f"{c['read_bytes_per_s'] / gb:.2f} GB/s ({c['read_vs_plain']:.2f} of plain)")
    return 0
