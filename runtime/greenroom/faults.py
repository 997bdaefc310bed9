"""Named kill points for the fault-injection tests.

``GREENROOM_TEST_KILL_AT=<point>`` (or ``<point>@<n>`` for its n-th visit) makes the
process SIGKILL itself when it reaches that point: no cleanup, no flush, exactly what
a node failure or the OOM killer does. ``GREENROOM_TEST_STOP_AT`` (same syntax) makes it
SIGSTOP itself there instead, so a test can act at that exact moment (flip a byte, run
a racing process) and then SIGCONT it: a race made deterministic. Either variable may
name several points, comma-separated (``instep-streamed,sync@2``): a test that acts at
two moments of one run. Unset (always, outside the tests), a point costs one dict lookup
per variable. The points are listed in docs/reliability.md.
"""

from __future__ import annotations

import os
import signal

ENV = "GREENROOM_TEST_KILL_AT"
STOP_ENV = "GREENROOM_TEST_STOP_AT"
_visits: dict[tuple[str, str], int] = {}


def kill_point(name: str) -> None:
    for env, signum in ((ENV, signal.SIGKILL), (STOP_ENV, signal.SIGSTOP)):
        wanted = os.environ.get(env)
        if not wanted:
            continue
        nths = [int(nth or 1) for point, _, nth in (spec.partition("@") for spec in wanted.split(",")) if point == name]
        if not nths:
            continue
        key = (env, name)
        _visits[key] = _visits.get(key, 0) + 1
        if _visits[key] in nths or (signum == signal.SIGKILL and _visits[key] > min(nths)):
            os.kill(os.getpid(), signum)
