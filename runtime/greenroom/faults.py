"""Named kill points for the fault-injection tests.

``GREENROOM_TEST_KILL_AT=<point>`` (or ``<point>@<n>`` for its n-th visit) makes the
process SIGKILL itself when it reaches that point: no cleanup, no flush, exactly what
a node failure or the OOM killer does. Unset (always, outside the tests), a kill point
costs one dict lookup. The points are listed in docs/reliability.md.
"""

from __future__ import annotations

import os
import signal

ENV = "GREENROOM_TEST_KILL_AT"
_visits: dict[str, int] = {}


def kill_point(name: str) -> None:
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    point, _, nth = wanted.partition("@")
    if point != name:
        return
    _visits[name] = _visits.get(name, 0) + 1
    if _visits[name] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
