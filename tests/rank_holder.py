"""A real process that holds a per-rank dir: prints its path, writes a file, then waits.

Used by the rank-dir and reclaim tests as the "live owner" (and, once SIGKILLed, the dead one).
"""

import signal
import sys
import time

from greenroom.dirs.rankdir import RankDir

# The holder stands for a trainer started in the foreground, where Ctrl-C raises. A shell
# starts background commands (``make test &``) with SIGINT ignored, the children inherit
# that, and RankDir rightly leaves an ignored signal alone: the SIGINT test then hung.
signal.signal(signal.SIGINT, signal.default_int_handler)

root, job, role, rank = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with RankDir(root, job=job, role=role, rank=rank) as rank_dir:
    with open(f"{rank_dir.subdir('offload')}/state.bin", "wb") as f:
        f.write(b"x" * 65536)
    try:
        # Printed inside the try: the test signals as soon as it reads the path, and a
        # signal between the print and the try would skip the "cleanup" line.
        print(rank_dir.path, flush=True)
        # Short sleeps: a signal whose handler is due just before a sleep starts waits for
        # that sleep to end (CPython checks for one between bytecodes, and the sleep's system
        # call is not interrupted by a signal already taken). The likely reason a test's
        # SIGTERM once went unanswered for all of a 600 s sleep.
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        print("cleanup", flush=True)
