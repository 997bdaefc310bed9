"""``greenroom doctor DIR``: is this dir fit to hold offloaded state?

Checks the filesystem type (tmpfs/ramfs keep the data in RAM), free space, O_DIRECT
support, the memlock limit (pinned staging needs it) and a quick bandwidth probe, then
prints one verdict line (or, with ``--json``, one object whose ``read_gbps`` and
``write_gbps`` are what ``greenroom plan --disk-read-gbps/--disk-write-gbps`` take). With
``--ranks N`` the probe runs at N ranks' concurrency (``bench.disk.node_bandwidth``), the
node's rates for ``plan --nproc-per-node N`` (``greenroom.cli.budget`` Note [node probe]).
Exit 0 when fit, 1 when not, 2 when DIR is unusable: not a dir, or one this user cannot
make a rank dir in (``greenroom.dirs.roots.root_problem``, the check ``train`` and ``plan``
make). The probes run in a rank dir of their own, removed after (and reclaimable, should
doctor be killed); DIR itself is never changed.
"""

from __future__ import annotations

import argparse
import json
import resource

from greenroom.cli import flags as cliflags
from greenroom.config import check_host_bytes
from greenroom.dirs.rankdir import RankDir
from greenroom.dirs.roots import check_existing_root
from greenroom.errors import ConfigError
from greenroom.io import fs
from greenroom.units import MIB, positive_int, rate_text, size_text

PROBE_BYTES = 256 * MIB
MIN_PROBE_BYTES = MIB


def _limit(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else size_text(value)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    cliflags.disk_dir(parser, positional=True, help="the dir to check (the run's --offload-train-disk-dir)")
    cliflags.chunk_mb(
        parser, help="staging chunk per mechanism, to check against the memlock limit (default %(default)s)"
    )
    parser.add_argument("--no-probe", action="store_true", help="skip the bandwidth probe")
    parser.add_argument(
        "--ranks",
        type=positive_int,
        default=1,
        metavar="N",
        help="ranks that will share this disk (the node's --nproc-per-node): probe at their concurrency (default 1)",
    )
    cliflags.json_flag(parser)


def _probe_bytes(directory: str, ranks: int = 1) -> int:
    """The probe's size per rank: a quarter of the free space over the ranks, at most
    ``PROBE_BYTES`` (the probe rounds it up to whole pages); under ``MIN_PROBE_BYTES`` there
    is no room to probe."""
    return min(PROBE_BYTES, fs.free_bytes(directory) // 4 // ranks)


def _raw_probe(scratch: str, directory: str, ranks: int):
    from greenroom.cli.bench.disk import node_bandwidth

    # Its blocks are no larger than the probe (``raw_block``): 64 MiB ones overran a disk
    # with less than that free (ENOSPC, a traceback).
    return node_bandwidth(scratch, _probe_bytes(directory, ranks), ranks)


def probe(directory: str, ranks: int = 1):
    """The quick raw bandwidth probe at ``ranks`` ranks' concurrency, mixed reads and writes
    included (``greenroom.cli.bench.disk.node_bandwidth``), sized to the free space, in a
    rank dir of its own under ``directory`` (never in it)."""
    if _probe_bytes(directory, ranks) < MIN_PROBE_BYTES:
        raise ConfigError(
            f"{directory} has {size_text(fs.free_bytes(directory))} free: too little to probe its "
            "bandwidth (or hold offloaded state); free some space or use a larger disk"
        )
    with RankDir(directory, role="doctor", allow_tmpfs=True) as rank_dir:
        return _raw_probe(rank_dir.path, directory, ranks)


def check(directory: str, *, chunk_mb: int, bandwidth: bool, ranks: int = 1) -> dict:
    """The checks as a dict (what ``--json`` prints); the probes write only in a rank dir
    of their own."""
    mount = fs.mount_of(directory)
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    need = 2 * chunk_mb * MIB
    roomy = _probe_bytes(directory, ranks) >= MIN_PROBE_BYTES
    with RankDir(directory, role="doctor", allow_tmpfs=True) as rank_dir:
        o_direct = fs.supports_o_direct(rank_dir.path)
        measured = _raw_probe(rank_dir.path, directory, ranks) if bandwidth and roomy else None
    result = {
        "dir": directory,
        "filesystem": mount.fstype,
        "source": mount.source,
        "mount_point": mount.mount_point,
        "free_bytes": fs.free_bytes(directory),
        "o_direct": o_direct,
        "memlock_bytes": None if soft == resource.RLIM_INFINITY else soft,
        "staging_bytes": need,
        # A warning, not a verdict: CUDA pins host memory through its driver, which this
        # limit does not bound, but some container runtimes enforce it there too.
        "memlock_low": soft != resource.RLIM_INFINITY and soft < need,
        "ranks": ranks,
        "read_gbps": None,
        "write_gbps": None,
        "mixed_read_gbps": None,
        "mixed_write_gbps": None,
        "problems": [],
    }
    if mount.fstype in fs.MEMORY_FILESYSTEMS:
        result["problems"].append(f"{mount.fstype} keeps the data in RAM")
    if not roomy:
        result["problems"].append(
            f"{size_text(result['free_bytes'])} free: too little to probe the bandwidth or hold offloaded state"
        )
    if measured is not None:
        result.update(
            read_gbps=measured.read_bytes_per_s / 1e9,
            write_gbps=measured.write_bytes_per_s / 1e9,
            mixed_read_gbps=measured.mixed_read_bytes_per_s and measured.mixed_read_bytes_per_s / 1e9,
            mixed_write_gbps=measured.mixed_write_bytes_per_s and measured.mixed_write_bytes_per_s / 1e9,
        )
    result["fit"] = not result["problems"]
    return result


def run(args: argparse.Namespace) -> int:
    directory = cliflags.resolve_disk_dir(args, "doctor")
    if args.chunk_mb <= 0:
        raise ConfigError(
            f"--offload-train-disk-chunk-mb must be a positive integer number of MiB, got {args.chunk_mb}"
        )
    check_host_bytes("--offload-train-disk-chunk-mb", args.chunk_mb, 2 * args.chunk_mb * MIB)
    check_existing_root(directory, name="doctor: DIR")
    r = check(directory, chunk_mb=args.chunk_mb, bandwidth=not args.no_probe, ranks=args.ranks)
    if args.json:
        print(json.dumps(r, sort_keys=True))
        return 0 if r["fit"] else 1
    print(f"filesystem: {r['filesystem']} ({r['source']} at {r['mount_point']})")
    print(f"free space: {size_text(r['free_bytes'])}")  # the unit fits the figure: 16 MiB is not "0.0 GB"
    print(f"O_DIRECT:   {'yes' if r['o_direct'] else 'no (buffered I/O with fdatasync + DONTNEED)'}")
    memlock = _limit(resource.RLIM_INFINITY if r["memlock_bytes"] is None else r["memlock_bytes"])
    print(f"memlock:    {memlock} (both mechanisms pin {size_text(r['staging_bytes'])} per rank)")
    if r["read_gbps"] is not None:
        n = r["ranks"]
        at = f"{n} ranks at once" if n > 1 else "one rank"
        mixed = (
            f"; at once: read {rate_text(r['mixed_read_gbps'] * 1e9)}, write {rate_text(r['mixed_write_gbps'] * 1e9)}"
            if r["mixed_read_gbps"]
            else ""
        )
        print(
            f"bandwidth:  write {rate_text(r['write_gbps'] * 1e9)}, read {rate_text(r['read_gbps'] * 1e9)}{mixed} "
            f"(quick probe, {at}; greenroom plan --nproc-per-node {n} --disk-read-gbps {r['read_gbps']:.2f} "
            f"--disk-write-gbps {r['write_gbps']:.2f}, or plan --measure-disk)"
        )
    if r["problems"]:
        print("verdict:    NOT FIT: " + "; ".join(r["problems"]))
        return 1
    warnings = warning_costs(r)
    for line in warnings:
        print(f"warning:    {line}")
    print(
        "verdict:    OK for offload and streaming"
        + (f", at the cost the {len(warnings)} warning(s) above name" if warnings else "")
    )
    return 0


def warning_costs(r: dict) -> list[str]:
    """Each warning of a dir that fits, with what it costs a run there."""
    out = []
    if r["memlock_low"]:
        out.append(
            f"the memlock limit ({_limit(r['memlock_bytes'])}) is below the staging "
            f"({size_text(r['staging_bytes'])}): where the container runtime enforces it on CUDA's pinned "
            "memory, a run fails at start-up pinning its staging; raise it (ulimit -l, the container's "
            "memlock rlimit)"
        )
    if not r["o_direct"]:
        out.append(
            "no O_DIRECT: every byte passes through the page cache (written with fdatasync, then dropped), "
            "which costs host CPU and memory bandwidth and makes a read probe look faster than the disk"
        )
    return out
