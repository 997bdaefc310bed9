"""``greenroom torchrun ARGS``: torchrun, exiting with the failed worker's own exit code.

torchrun exits 1 whatever its workers exited with, so a Kubernetes ``podFailurePolicy``
could not tell a config error (exit 2: fail the job) from a preemption (exit 143: run
again and resume). This runs torchrun's own launcher (``torch.distributed.run``, same
arguments) and, when a worker fails, exits with the first failure's code (a worker killed
by a signal: 128 + the signal, as a shell reports it). A signal to the launcher itself
(the kubelet's SIGTERM on a pod's deletion or a drain, Ctrl-C) stops the workers, as
torchrun does, and exits 128 + the signal (143 for SIGTERM: preempted, run again); plain
torchrun exits 1 there, with a traceback. Everything else is torchrun's, the trainer's
``--help`` too (no option of greenroom's own is parsed here).
"""

from __future__ import annotations

import argparse
import sys


def configure_parser(parser: argparse.ArgumentParser) -> None:
    # torchrun's arguments, then the trainer's command: passed on as they are (greenroom.cli.main).
    parser.usage = "greenroom torchrun [TORCHRUN ARGS] COMMAND [ARGS]"
    parser.set_defaults(pass_on=True)


def exit_code(exitcode: int) -> int:
    """A worker's exit code as its launcher's: 128 + N for a worker killed by signal N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def run(args: argparse.Namespace) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun.run(torchrun.parse_args(args.pass_on if args.pass_on is not True else []))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = exit_code(failure.exitcode)
        print(f"greenroom torchrun: worker rank {rank} failed with exit code {code}", file=sys.stderr)
        return code or 1
    except SignalException as e:  # the agent stopped its workers on the way out
        print(f"greenroom torchrun: stopped by signal {e.sigval.name}; the workers were stopped too", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0
