"""``greenroom reclaim``: the command line of the stale-file janitor.

The pass itself is ``greenroom.dirs.reclaim`` (lock rule, no torch); with ``--kubernetes`` the
command runs ``greenroom.dirs.janitor`` (the pod rule, ``greenroom.dirs.pod_rule``) on top of
it. Wiring the two here keeps the layers looking down: the janitor uses reclaim, reclaim
knows nothing of it.
"""

from __future__ import annotations

import argparse
import os

from greenroom.dirs.reclaim import check_interval, check_seconds, print_report, reclaim
from greenroom.errors import ConfigError
from greenroom.io import fs
from greenroom.log import get_logger

log = get_logger(__name__)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", metavar="ROOT", help="the node's offload root (e.g. --offload-train-disk-dir)")
    parser.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    parser.add_argument(
        "--min-age",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="only reclaim dirs whose owner record is at least this old (default 0)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument(
        "--missing-ok",
        action="store_true",
        help="a ROOT that does not exist is an empty pass, not an error (prologs on fresh nodes)",
    )
    k8s = parser.add_argument_group("Kubernetes janitor (see greenroom.dirs.janitor)")
    k8s.add_argument(
        "--kubernetes", action="store_true", help="also ask the API server which pods on this node still exist"
    )
    k8s.add_argument("--node-name", default=None, help="this node's name (default $NODE_NAME)")
    k8s.add_argument(
        "--interval", type=float, default=None, metavar="SECONDS", help="repeat every SECONDS (default: one pass)"
    )
    k8s.add_argument(
        "--metrics-port", type=int, default=None, metavar="PORT", help="serve Prometheus counters on this port"
    )


def run(args: argparse.Namespace) -> int:
    check_seconds("--min-age", args.min_age)
    if args.interval is not None:
        check_interval(args.interval)
    if args.kubernetes:
        from greenroom.dirs.janitor import JanitorConfig, run_janitor  # the kubernetes client only when asked

        pod = (os.environ.get("POD_NAMESPACE", ""), os.environ.get("POD_NAME", ""))
        return run_janitor(
            JanitorConfig(
                root=args.root,
                node_name=args.node_name or os.environ.get("NODE_NAME", ""),
                pod="/".join(pod) if all(pod) else "",
                interval=args.interval,
                metrics_port=args.metrics_port or 0,
                min_age=args.min_age,
                dry_run=args.dry_run,
                as_json=args.json,
            )
        )
    if args.interval is not None or args.metrics_port is not None or args.node_name is not None:
        raise ConfigError("--interval, --metrics-port and --node-name need --kubernetes")
    if fs.is_memory_backed(args.root) and os.path.isdir(args.root):
        log.warning(f"{args.root} is memory-backed (tmpfs); reclaiming anyway")
    report = reclaim(args.root, dry_run=args.dry_run, min_age=args.min_age, missing_ok=args.missing_ok)
    print_report(report, as_json=args.json)
    return 1 if report.errors else 0
