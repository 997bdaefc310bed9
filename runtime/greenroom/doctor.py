"""``greenroom doctor DIR``: is this dir fit to hold offloaded state?

Checks the filesystem type (tmpfs/ramfs keep the data in RAM), free space, O_DIRECT
support, the memlock limit (pinned staging needs it) and a quick bandwidth probe, then
prints one verdict line. Exit 0 when fit, 1 when not, 2 when DIR is unusable: not a
dir, or one this user cannot make a rank dir in (``greenroom.rankdir.root_problem``, the
check ``train`` and ``plan`` make). The probes run in a rank dir of their own, removed
after (and reclaimable, should doctor be killed); DIR itself is never changed.
"""

from __future__ import annotations

import argparse
import os
import resource

from greenroom import fs
from greenroom.config import DEFAULT_CHUNK_MB, MIB, check_host_bytes
from greenroom.errors import ConfigError
from greenroom.rankdir import RankDir, check_root

PROBE_BYTES = 256 * MIB


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else f"{value / MIB:.0f} MiB"


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="the dir to check (e.g. --offload-train-disk-dir)")
    parser.add_argument("--chunk-mb", type=int, default=DEFAULT_CHUNK_MB,
                        help="staging chunk per mechanism, to check against the memlock limit")
    parser.add_argument("--no-probe", action="store_true", help="skip the bandwidth probe")


def run(args: argparse.Namespace) -> int:
    if args.chunk_mb <= 0:
        raise ConfigError(f"--chunk-mb must be a positive integer number of MiB, got {args.chunk_mb}")
    check_host_bytes("--chunk-mb", args.chunk_mb, 2 * args.chunk_mb * MIB)
    if not os.path.isdir(args.dir):
        raise ConfigError(f"doctor: DIR {args.dir} is not a directory (create it on node-local NVMe first)")
    check_root(args.dir, name="doctor: DIR")
    problems = []
    mount = fs.mount_of(args.dir)
    print(f"filesystem: {mount.fstype} ({mount.source} at {mount.mount_point})")
    if mount.fstype in fs.MEMORY_FILESYSTEMS:
        problems.append(f"{mount.fstype} keeps the data in RAM")
    free = fs.free_bytes(args.dir)
    print(f"free space: {free / 2**30:.1f} GiB")
    with RankDir(args.dir, role="doctor", allow_tmpfs=True) as rank_dir:
        return _probe(args, rank_dir.path, free, problems)


def _probe(args: argparse.Namespace, scratch: str, free: int, problems: list[str]) -> int:
    direct = fs.supports_o_direct(scratch)
    print(f"O_DIRECT:   {'yes' if direct else 'no (buffered I/O with fdatasync + DONTNEED)'}")
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    need = 2 * args.chunk_mb * MIB
    print(f"memlock:    {_limit(soft)} (both mechanisms pin {need / MIB:.0f} MiB per rank)")
    if soft != resource.RLIM_INFINITY and soft < need:
        # A warning, not a verdict: CUDA pins host memory through its driver, which this
        # limit does not bound, but some container runtimes enforce it there too.
        print("warning:    memlock limit is below the staging; if pinning fails, raise it "
              "(ulimit -l / the container's memlock rlimit)")
    if not args.no_probe:
        from greenroom.bench.disk import raw_bandwidth

        probe = raw_bandwidth(scratch, min(PROBE_BYTES, max(free // 4, MIB)))
        print(f"bandwidth:  write {probe.write_bytes_per_s / 1e9:.2f} GB/s, "
              f"read {probe.read_bytes_per_s / 1e9:.2f} GB/s (quick probe)")
    if problems:
        print("verdict:    NOT FIT: " + "; ".join(problems))
        return 1
    print("verdict:    OK for offload and streaming")
    return 0
