"""``greenroom bench disk|stream|offload|codec|node``: one module per benchmark.

Benchmarks report what they measure beside the raw figure from the same run (plain
O_DIRECT threads for the disk, a plain pinned copy for host memory) and the ratio, so a
number is never read without its bound.
"""

from __future__ import annotations

import argparse
import importlib

from greenroom.cli.flags import DefaultsFormatter

BENCHMARKS = {
    "disk": ("greenroom.cli.bench.disk", "sequential bandwidth through the I/O layer vs raw O_DIRECT"),
    "stream": ("greenroom.cli.bench.stream", "streamed optimizer step time vs the disk bound"),
    "offload": ("greenroom.cli.bench.offload", "actor sleep/wake bandwidth vs raw disk or pinned copy"),
    "codec": ("greenroom.cli.bench.codec", "frame codec encode/decode GB/s vs the raw disk it has to beat"),
    "node": ("greenroom.cli.bench.node", "N ranks streaming and sleeping on one disk at once: aggregate, spread, plan"),
}


def configure_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, (module_name, summary) in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        bench_parser = sub.add_parser(name, help=summary, description=summary, formatter_class=DefaultsFormatter)
        module.configure_parser(bench_parser)
        bench_parser.set_defaults(_bench=module.run)


def run(args: argparse.Namespace) -> int:
    return args._bench(args)
