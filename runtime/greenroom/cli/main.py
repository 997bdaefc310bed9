"""The ``greenroom`` command: wiring only.

Each subcommand lives in its own module exposing ``configure_parser(parser)`` and
``run(args) -> int``. Only the chosen one is imported, so ``greenroom reclaim`` (run by
init containers and Slurm prologs) never pays for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

import greenroom
from greenroom import log
from greenroom.cli.flags import DefaultsFormatter
from greenroom.errors import GreenroomError
from greenroom.ranks import peer_gone

COMMANDS = {
    "train": ("greenroom.cli.train", "the colocated train/sleep/rollout/wake loop"),
    "plan": ("greenroom.cli.plan", "the run's budget per rank and node: GPU, host memory, disk, seconds"),
    "reclaim": ("greenroom.cli.reclaim", "remove per-rank dirs whose owner died"),
    "doctor": ("greenroom.cli.doctor", "check a dir for offload: filesystem, space, O_DIRECT, memlock, GB/s"),
    "bench": ("greenroom.cli.bench", "benchmarks: disk, stream, offload, codec"),
    "report": ("greenroom.cli.report", "plot a metrics .jsonl (resumed runs too) to a PNG"),
    "slurm": ("greenroom.cli.slurm", "render or submit the Slurm templates"),
    "torchrun": ("greenroom.cli.torchrun", "torchrun, exiting with the failed worker's exit code"),
}


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser. Unrecognized arguments are reported by the innermost
    (sub)command parser that was used, with its own usage (``greenroom bench disk``'s, not
    ``greenroom``'s), unless the subcommand takes them (``pass_on``, ``greenroom torchrun``)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras and not getattr(namespace, "pass_on", False):
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="greenroom", description=greenroom.__doc__)
    parser.add_argument("--version", action="version", version=f"greenroom {greenroom.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_CommandParser)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, summary) in COMMANDS.items():
        # torchrun's arguments and the trainer's follow `greenroom torchrun`, a trainer's
        # --help among them: no -h of greenroom's own there (torchrun's --help answers).
        command_parser = sub.add_parser(
            name, help=summary, description=summary, add_help=name != "torchrun", formatter_class=DefaultsFormatter
        )
        if name == chosen:
            module = importlib.import_module(module_name)
            module.configure_parser(command_parser)
            command_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    log.configure()
    try:
        parser = build_parser(argv)
    except (ValueError, GreenroomError) as e:  # e.g. a bad $GREENROOM_ARGS, read for the defaults
        chosen = next((a for a in argv if not a.startswith("-")), "")
        print(f"greenroom {chosen}: error: {e}", file=sys.stderr)
        return 2
    args, passed_on = parser.parse_known_args(argv)
    if passed_on:
        if not getattr(args, "pass_on", False):
            parser.error(f"unrecognized arguments: {' '.join(passed_on)}")
        args.pass_on = passed_on  # e.g. torchrun's own arguments, untouched
    try:
        return args._run(args) or 0
    except (ValueError, GreenroomError) as e:
        # Notes are what went wrong while cleaning up after it (see Trainer._close).
        notes = "".join(f" ({note})" for note in getattr(e, "__notes__", ()))
        print(f"greenroom {args.command}: error: {e}{notes}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        gone = peer_gone(e)
        if gone is None:
            raise  # a bug: its traceback is what a report needs
        print(f"greenroom {args.command}: error: {gone}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # ^C: the command's `with` blocks and finally clauses have cleaned up on the way
        # here (a rank dir turns SIGINT into this exception for that); the shell's code.
        print(f"greenroom {args.command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
