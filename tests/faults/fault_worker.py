"""A process that streams optimizer state or sleeps/wakes an actor on a given dir and
breaks the disk under itself at a chosen I/O call; used by tests/faults/test_faults.py.

    python fault_worker.py SCENARIO DIR BREAK [ARG]

SCENARIO: ``step`` (StreamingAdam, 4 buckets), ``sleep`` or ``wake`` (the portable
actor offloader, disk target); ``wake-retry`` and ``sleep-retry`` run under strace's
fault injection instead (BREAK ``none``): they catch the first failure, print what state
the offloader is in, and try again (see ``retry``). BREAK: ``shutdown`` (the ext4 shutdown ioctl on the
file: every later I/O of the filesystem fails with EIO), ``none`` (the disk breaks by
itself: a thin device that runs out of space) or ``dm:NAME`` (switch the
device-mapper device NAME to the ``error`` target). The break happens right before the
ARG-th read (``step``, ``wake``) or write (``sleep``) of a state file, from the I/O
thread that does it, so the fault lands in the middle of the phase. Exit 3 with the
error on stderr when greenroom reports a ``GreenroomError``, 0 when nothing failed.
"""

import fcntl
import os
import struct
import subprocess
import sys

import torch

from greenroom.errors import GreenroomError
from greenroom.io.engine import StateFile

EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
SHUTDOWN_NOLOGFLUSH = 2


def break_disk(how: str, fd: int) -> None:
    if how == "shutdown":
        fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", SHUTDOWN_NOLOGFLUSH))
        return
    name = how.split(":", 1)[1]
    sectors = subprocess.run(
        ["blockdev", "--getsz", f"/dev/mapper/{name}"], capture_output=True, text=True, check=True
    ).stdout.strip()
    for cmd in (
        ["dmsetup", "suspend", "--nolockfs", name],
        ["dmsetup", "load", name, "--table", f"0 {sectors} error"],
        ["dmsetup", "resume", "--noudevsync", name],
    ):
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)


def arm(op: str, nth: int, how: str) -> None:
    """Break the disk right before the nth ``op`` ("read" or "write") of any state file."""
    if how == "none":
        return
    original = getattr(StateFile, op)
    calls = [0]

    def hooked(self, buf, file_offset):
        calls[0] += 1
        if calls[0] == nth:
            break_disk(how, self.fd)
        return original(self, buf, file_offset)

    setattr(StateFile, op, hooked)


def main() -> int:
    scenario, directory, how = sys.argv[1:4]
    nth = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    torch.manual_seed(0)
    if scenario == "step":
        from greenroom.optim import StreamingAdam

        params = [torch.nn.Parameter(torch.randn(400_000, dtype=torch.bfloat16)) for _ in range(4)]
        opt = StreamingAdam(params, state_dir=directory, bucket_numel=400_000, chunk_mb=1, resident_numel=0)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        arm("read", nth, how)
        opt.step()
        opt.close()
        return 0
    if scenario.endswith("-retry"):
        return retry(scenario, directory)
    from greenroom.actor.offloader import PortableOffloader

    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(4)))  # 16 MiB
    # Not closed on purpose: a failed phase must leave no I/O in flight, so the process
    # exits cleanly even when nobody closes the engine.
    offloader = PortableOffloader(target="disk", offload_dir=directory, chunk_bytes=1 << 20).track(model)
    if scenario == "sleep":
        arm("write", nth, how)
        offloader.sleep()
        offloader.wake()
    else:
        offloader.sleep()
        arm("read", nth, how)
        offloader.wake()
    offloader.close()
    return 0


def retry(scenario: str, directory: str) -> int:
    """An actor of many small tensors (so a transfer that failed early is long finished
    when the last is submitted) sleeps and wakes; the first failure of the phase strace
    breaks is caught and reported on stdout with the offloader's state, then the phase is
    tried again and the tensors compared with what they were before the sleep. strace
    fails the third call of each I/O thread once, and a thread that made fewer calls in
    the first try makes its third in a later one, so the phase is tried until it succeeds:
    at most once more per I/O thread."""
    from greenroom.actor.offloader import PortableOffloader

    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(128)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    offloader = PortableOffloader(target="disk", offload_dir=directory, chunk_bytes=1 << 16).track(model)

    def same() -> bool:
        return all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    first = offloader.sleep if scenario == "sleep-retry" else offloader.wake
    if scenario == "wake-retry":
        offloader.sleep()
    try:
        first()
        print("first: returned")
    except GreenroomError as e:
        print(f"first: raised: {e}")
    print(f"asleep: {offloader.is_asleep}")
    print(f"files: {sorted(os.listdir(directory))}")
    if scenario == "sleep-retry":
        print(f"awake and unchanged: {not offloader.is_asleep and same()}")
        try:
            offloader.wake()
        except GreenroomError as e:
            print(f"wake: raised: {e}")
        _until_done(offloader.sleep)
    _until_done(offloader.wake)
    print(f"identical after the retry: {same()}")
    offloader.close()
    return 0


def _until_done(phase, tries: int = 10) -> None:
    for attempt in range(tries):
        try:
            phase()
            return
        except GreenroomError:
            if attempt == tries - 1:
                raise


if __name__ == "__main__":
    try:
        sys.exit(main())
    except GreenroomError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3)
