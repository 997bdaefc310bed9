"""A SIGTERM (made a SystemExit by the rank dir) or Ctrl-C that lands while a rank dir
closes has its effect once the dir is gone (``greenroom.rankdir`` Note [an interrupted
close]).

Found by reading ``RankDir.close`` during a SIGTERM stress of ``greenroom train`` (the
twentieth session; its random kills never landed there): a signal raised at once in
the middle of the close's delete, and the run ended 143 with its aside
dir (``.greenroom-reclaim-*``, holding whatever the delete had not reached: at worst the
whole streamed state) and its job/role parents left until the next ``greenroom reclaim``.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from greenroom import rankdir
from greenroom.rankdir import RankDir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
        real_wipe = rankdir._wipe_contents

        def wipe(path):
            deliver()
            real_wipe(path)

        monkeypatch.setattr(rankdir, "_wipe_contents", wipe)
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
        disk_dir, monkeypatch, request, signum, raised):
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
    assert signal.getsignal(signum) == (signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL), \
        "the close did not give the signal its handler back"


@pytest.mark.parametrize("point", ["rankdir-parents", "rankdir-close"])
def test_greenroom_train_sigtermed_in_its_open_or_close_exits_143_and_leaves_nothing(disk_dir, point):
    """The real thing: a trainer stopped (SIGSTOP) at ``rankdir-parents`` in its rank
    dir's open or at ``rankdir-close``, sent SIGTERM and continued: exit 143, one line at
    most, and nothing under the offload root."""
    root = os.path.join(disk_dir, "offload")
    cmd = [sys.executable, "-m", "greenroom.cli", "train", "--iterations", "1", "--prompts", "4", "--group-size", "2",
           "--minibatches", "1", "--d-model", "16", "--no-progress", "--dtype", "bf16", "--offload-train",
           "--offload-train-target", "disk", "--stream-optimizer-state-to-disk", "--offload-train-disk-dir", root,
           "--metrics", os.path.join(disk_dir, "m.jsonl")]
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "runtime"), "OMP_NUM_THREADS": "1",
           "GREENROOM_TEST_STOP_AT": point}
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
