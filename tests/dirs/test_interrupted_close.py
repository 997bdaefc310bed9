"""A SIGTERM (made a SystemExit by the rank dir) or Ctrl-C that lands while a rank dir
closes has its effect once the dir is gone (``greenroom.dirs.rankdir`` Note [an interrupted
close]).

What it guards against: a signal raised at once in the middle of the close's delete
would end the run 143 with its aside dir (``.greenroom-reclaim-*``, holding whatever the
delete had not reached: at worst the whole streamed state) and its job/role parents
left until the next ``greenroom reclaim``. Random kills of a SIGTERM stress rarely land
there, so each case is stopped at a named point.
"""

import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from greenroom.dirs import rankdir
from greenroom.dirs.rankdir import RankDir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fill(rank_dir):
    optim = rank_dir.subdir("optim")
    for name in ("bucket-00000.bin", "bucket-00001.bin"):
        with open(os.path.join(optim, name), "wb") as f:
            f.write(os.urandom(1 << 16))
    with open(os.path.join(rank_dir.path, "actor.bin"), "wb") as f:
        f.write(os.urandom(1 << 16))


@pytest.mark.parametrize("gate", ["before-the-delete", "rankdir-close"])
@pytest.mark.parametrize("signum,raised", [(signal.SIGTERM, SystemExit), (signal.SIGINT, KeyboardInterrupt)])
def test_a_signal_in_the_close_is_raised_once_the_dir_is_gone(disk_dir, monkeypatch, request, gate, signum, raised):
    """The signal arrives at a gate inside the close: before its delete starts (every
    file still there), or at ``rankdir-close`` (the files deleted, the lock file and the
    aside dir not yet). The close finishes, then the signal's exception is raised."""
    # The signal at its default, as from a terminal: `make test` in the background hands
    # its workers SIGINT ignored, and a rank dir leaves an ignored signal ignored.
    start = signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    request.addfinalizer(lambda: signal.signal(signum, start))
    root = os.path.join(disk_dir, "root")
    before = signal.getsignal(signum)
    rank_dir = RankDir(root, role="actor", rank=0, job="job").open()
    fill(rank_dir)

    def deliver():
        assert callable(signal.getsignal(signum)), "the signal would end the test process"
        os.kill(os.getpid(), signum)  # its Python handler runs at the next bytecode, here

    if gate == "rankdir-close":
        monkeypatch.setattr(rankdir, "kill_point", lambda name: deliver() if name == "rankdir-close" else None)
    else:
        real_wipe = rankdir.wipe_contents

        def wipe(path):
            deliver()
            real_wipe(path)

        monkeypatch.setattr(rankdir, "wipe_contents", wipe)
    with pytest.raises(raised) as caught:
        rank_dir.close()
    if raised is SystemExit:
        assert caught.value.code == 128 + signal.SIGTERM
    assert os.listdir(root) == [], "the interrupted close left files for reclaim"
    assert not rank_dir.is_open
    assert signal.getsignal(signum) == before, "the close did not give the signal its handler back"
    monkeypatch.undo()
    RankDir(root, role="actor", rank=0, job="job").open().close()  # the lock is free


@pytest.mark.parametrize("signum,raised", [(signal.SIGTERM, SystemExit), (signal.SIGINT, KeyboardInterrupt)])
def test_a_signal_in_the_open_is_raised_once_the_dir_is_open_and_closing_leaves_nothing(
    disk_dir, monkeypatch, request, signum, raised
):
    """The signal arrives at ``rankdir-parents`` (the job/role dirs made, the rank dir
    not yet): the open finishes and sets its exit hooks, then the signal's exception is
    raised through the rank dir's handler; the close that follows (atexit's, on the way
    out) leaves nothing. At its default the signal killed the process there, and the
    parents stayed for reclaim."""
    start = signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    request.addfinalizer(lambda: signal.signal(signum, start))
    root = os.path.join(disk_dir, "root")
    os.makedirs(root)

    def deliver(name):
        if name == "rankdir-parents":
            assert callable(signal.getsignal(signum)), "the signal would end the test process"
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(rankdir, "kill_point", deliver)
    rank_dir = RankDir(root, role="actor", rank=0, job="job")
    with pytest.raises(raised) as caught:
        rank_dir.open()
    if raised is SystemExit:
        assert caught.value.code == 128 + signal.SIGTERM
    assert rank_dir.is_open and os.path.isdir(rank_dir.path)
    rank_dir.close()
    assert os.listdir(root) == []
    assert signal.getsignal(signum) == (signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL), (
        "the close did not give the signal its handler back"
    )


@pytest.mark.parametrize("point", ["rankdir-parents", "rankdir-close"])
def test_greenroom_train_sigtermed_in_its_open_or_close_exits_143_and_leaves_nothing(disk_dir, point):
    """The real thing: a trainer stopped (SIGSTOP) at ``rankdir-parents`` in its rank
    dir's open or at ``rankdir-close``, sent SIGTERM and continued: exit 143, one line at
    most, and nothing under the offload root."""
    root = os.path.join(disk_dir, "offload")
    cmd = [
        sys.executable,
        "-m",
        "greenroom.cli.main",
        "train",
        "--iterations",
        "1",
        "--prompts",
        "4",
        "--group-size",
        "2",
        "--minibatches",
        "1",
        "--d-model",
        "16",
        "--no-progress",
        "--dtype",
        "bf16",
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--stream-optimizer-state-to-disk",
        "--offload-train-disk-dir",
        root,
        "--metrics",
        os.path.join(disk_dir, "m.jsonl"),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.path.join(REPO, "runtime"),
        "OMP_NUM_THREADS": "1",
        "GREENROOM_TEST_STOP_AT": point,
    }
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            with open(f"/proc/{proc.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err
    assert os.listdir(root) == [], f"the trainer, interrupted at {point}, left files for reclaim"


def wait_asleep(pid):
    """Until the main thread of ``pid`` sleeps in one wait (no context switch for half a
    second; the trainer's wait for a publish wakes once a second to count the signals
    held): True; False once the process ends."""
    deadline, seen, since = time.monotonic() + 120, None, 0.0
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/task/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f)
        except FileNotFoundError:
            return False
        now = tuple(fields[k].split()[0] for k in ("State", "voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"))
        if now[0] == "Z":  # exited, or exiting: its other threads going
            return False
        if now != seen:
            seen, since = now, time.monotonic()
        elif now[0] == "S" and time.monotonic() - since >= 0.5:
            return True
        time.sleep(0.02)
    raise AssertionError(f"the main thread of {pid} never settled in a wait")


def stopped(proc):
    """Until ``proc`` has stopped itself at its stop point."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        with open(f"/proc/{proc.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.05)
    raise AssertionError(proc.communicate()[1][-2000:] if proc.poll() is not None else "never stopped")


def async_save_run(disk_dir, iterations, stops):
    """``greenroom train --async-save`` stopped at ``instep-streamed`` (iteration 1's step
    writing its streamed state into the staged dir, before the publish starts), with a
    FIFO, ``gate``, put into that dir and the run continued: the publish's ``fsync_tree``
    blocks opening it until the test opens the other end, then fails on it (a FIFO has no
    fsync), and the failed save discards its staged dir, as any failed publish does.
    Returns the process, the offload root and the FIFO."""
    from greenroom.io import publish

    root, ckpt = os.path.join(disk_dir, "offload"), os.path.join(disk_dir, "ckpt")
    cmd = [
        sys.executable,
        "-m",
        "greenroom.cli.main",
        "train",
        "--iterations",
        iterations,
        "--prompts",
        "4",
        "--group-size",
        "2",
        "--minibatches",
        "1",
        "--d-model",
        "16",
        "--no-progress",
        "--dtype",
        "bf16",
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--stream-optimizer-state-to-disk",
        "--offload-train-disk-dir",
        root,
        "--metrics",
        os.path.join(disk_dir, "m.jsonl"),
        "--save",
        ckpt,
        "--save-interval",
        "1",
        "--async-save",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.path.join(REPO, "runtime"),
        "OMP_NUM_THREADS": "1",
        "GREENROOM_TEST_STOP_AT": stops,
    }
    # SIGINT at its default, as from a terminal (see above).
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        stopped(proc)
        gate = os.path.join(ckpt, "iter_0000001" + publish.NEW_SUFFIX, "gate")
        os.mkfifo(gate)
        proc.send_signal(signal.SIGCONT)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, root, gate


def assert_interrupted(proc, err, root):
    """Ended by its Ctrl-C: 130, one line, and nothing left in the offload root."""
    assert proc.returncode == 128 + signal.SIGINT, err[-2000:]
    assert err.splitlines()[-1] == "greenroom train: interrupted" and "Traceback" not in err, err[-2000:]
    assert os.listdir(root) == []


@pytest.mark.parametrize(
    "first_in,second", [("the-loops-wait", None), ("an-iteration", signal.SIGTERM), ("an-iteration", signal.SIGINT)]
)
def test_signals_while_the_trainer_waits_for_an_async_save_let_it_end_then_clean_up(disk_dir, first_in, second):
    """Ctrl-C ends a ``--async-save`` run while a publish is in flight, landing in the
    loop's wait for it (``the-loops-wait``) or in the next iteration (``an-iteration``,
    stopped at ``sync@2``, whence the close waits for the publish, where SIGTERM or a
    second Ctrl-C follows). Raised in a wait, a signal's exception would make Python's
    ``Thread.join`` take the publishing thread for stopped, so the close would go on at
    once, closing the files under it, and the process would exit, killing it mid-publish;
    raised in the close's wait, it would also skip the close's cleanups (left to atexit
    and the garbage collector, which a one-rank run cannot tell apart). The signal in a
    wait waits for the publish to end (a second one in the same wait would end it: the next
    test), the close then runs in full, and the Ctrl-C that ended the run is what the
    user sees: exit 130, nothing left. The publish is held by ``async_save_run``'s FIFO."""
    proc, root, gate = async_save_run(
        disk_dir, *(("1", "instep-streamed") if first_in == "the-loops-wait" else ("2", "instep-streamed,sync@2"))
    )
    try:
        if first_in == "the-loops-wait":
            assert wait_asleep(proc.pid)  # the loop waits for the publish
        else:
            stopped(proc)  # at sync@2, the publish beside it
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGCONT)
        assert wait_asleep(proc.pid), "the run ended with its publish still in flight"
        if second is not None:
            proc.send_signal(second)
            assert wait_asleep(proc.pid), "the run ended with its publish still in flight"
        deadline = time.monotonic() + 60
        while True:  # the other end, once the publish has opened its own
            try:
                os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))
                break
            except OSError as e:
                assert e.errno == errno.ENXIO and time.monotonic() < deadline and proc.poll() is None, e
                time.sleep(0.05)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_interrupted(proc, err, root)
    assert sorted(os.listdir(disk_dir)) == ["ckpt", "m.jsonl", "offload"], "a cleanup was skipped"
    assert os.listdir(os.path.join(disk_dir, "ckpt")) == [], "the publish cut short"


@pytest.mark.parametrize(
    "first_in,signals",
    [
        ("the-loops-wait", (signal.SIGINT, signal.SIGINT)),
        ("the-loops-wait", (signal.SIGTERM, signal.SIGINT)),
        ("the-close", (signal.SIGTERM, signal.SIGTERM)),
    ],
)
def test_a_second_signal_ends_the_wait_for_a_publish_that_never_ends(disk_dir, first_in, signals):
    """A publish that never ends (rank 0's waits without a deadline for the manifest of a
    rank killed mid-save; here ``async_save_run``'s FIFO, never opened while the trainer
    runs) held every SIGTERM and Ctrl-C for ever: only SIGKILL stopped the trainer. Two
    signals come in one wait: the loop's (Ctrl-C twice, or SIGTERM, which the loop keeps
    for its preemption save, then Ctrl-C) or the close's, after a Ctrl-C in iteration 2
    (stopped at ``sync@2``; then SIGTERM twice). The second ends the wait: the trainer
    exits by the Ctrl-C, 130 and one line, the close having run under the publish, which
    is given up (its thread a daemon) and nothing left in the offload root. The staged
    ``ckpt/iter_0000001.new`` (the rank's part, the meta and the FIFO; no generation record yet) stays
    beside the checkpoint, as after a forced exit: the next run's settle discards it."""
    from greenroom.io import publish

    proc, root, gate = async_save_run(
        disk_dir, *(("1", "instep-streamed") if first_in == "the-loops-wait" else ("2", "instep-streamed,sync@2"))
    )
    try:
        if first_in == "the-close":
            stopped(proc)  # at sync@2, the publish beside it
            proc.send_signal(signal.SIGINT)
            proc.send_signal(signal.SIGCONT)
        for signum in signals:
            assert wait_asleep(proc.pid), "the run ended with its publish still in flight"
            proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_interrupted(proc, err, root)
    # The FIFO's only opener died with the process: nothing is left blocked on it.
    staged = os.path.dirname(gate)
    assert sorted(os.listdir(disk_dir)) == ["ckpt", "m.jsonl", "offload"]
    assert os.listdir(os.path.join(disk_dir, "ckpt")) == ["iter_0000001.new"]
    assert sorted(os.listdir(staged)) == ["gate", "meta.json", "rank00000"], "the staged save, cut short in its publish"
    said = publish.recover(os.path.join(disk_dir, "ckpt", "iter_0000001"))  # the next run's settle
    assert said.startswith(f"discarded {staged}, incomplete") and os.listdir(os.path.join(disk_dir, "ckpt")) == []
