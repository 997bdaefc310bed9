"""``greenroom slurm render|submit CONFIG.yaml``: print the sbatch script, or submit it.

``submit`` validates and renders first, so a bad value never reaches the queue, pipes
the script to ``sbatch`` and prints the job id. The script makes its own log dir, so
``render -o job.sh && sbatch job.sh`` runs the same job. ``--test-only`` asks ``sbatch
--test-only`` instead: Slurm checks the request without queueing it.
"""

from __future__ import annotations

import argparse
import sys

from greenroom.errors import ConfigError
from greenroom.slurm import sbatch
from greenroom.slurm.config import load_config
from greenroom.slurm.render import render


def configure_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="slurm_command", metavar="ACTION", required=True)
    render_parser = sub.add_parser("render", help="print the sbatch script for a job config")
    render_parser.add_argument("config", metavar="CONFIG.yaml")
    render_parser.add_argument("-o", "--output", metavar="FILE", help="write the script here instead of stdout")
    submit_parser = sub.add_parser("submit", help="render the job config and sbatch it; prints the job id")
    submit_parser.add_argument("config", metavar="CONFIG.yaml")
    submit_parser.add_argument(
        "--test-only", action="store_true", help="only ask Slurm whether it would accept the job (sbatch --test-only)"
    )


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    try:
        script = render(config, source=args.config)
    except ValueError as e:  # a missing or broken template: name the config that chose it
        raise ConfigError(f"{args.config}: {e}") from None
    if args.slurm_command == "render":
        if args.output:
            sbatch.write_script(args.output, script)
        else:
            sys.stdout.write(script)
        return 0
    if args.test_only:
        print(sbatch.test_only(script))
        return 0
    print(sbatch.submit(script))
    return 0
