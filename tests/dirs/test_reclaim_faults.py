"""Reclaim under faults: a live dir swapped in after the checks, a reclaimer SIGKILLed
mid-delete, an aside symlink, a reclaimer still at work, and ranks closing their dirs
beside reclaimers and successors. Real processes and files."""

import fcntl
import os
import signal
import subprocess
import sys

import pytest

from greenroom.dirs.rankdir import RankDir
from greenroom.dirs.reclaim import TRASH_PREFIX, reclaim
from tests.cli_support import greenroom, greenroom_stopped_at, one_line_error, wait_stopped
from tests.dirs.test_rankdir import start_holder
from tests.dirs.test_reclaim import dead_owner
from tests.train.test_loop import env


def aside_entries(root):
    return [os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files if n.startswith(TRASH_PREFIX)]


def test_a_live_dir_swapped_in_after_the_checks_is_put_back_untouched(disk_dir):
    dead = dead_owner(disk_dir, job="job")
    live_proc, live = start_holder(os.path.join(disk_dir, "elsewhere"), job="other")
    try:

        def swap_then_say_stale(path, owner):
            # Between reclaim's lock check and its rename: the checked dir leaves, a live one
            # (its lock held by a running process) takes its name.
            if path != dead:
                return "keep"
            os.rename(path, os.path.join(disk_dir, "moved-away"))
            os.rename(live, path)
            return "stale"

        report = reclaim(disk_dir, policy=swap_then_say_stale)
        [decision] = [d for d in report.decisions if d.path == dead]
        assert decision.action == "error" and "replaced after it was checked" in decision.reason
        assert os.path.isfile(os.path.join(dead, "offload", "state.bin"))  # the live one, at the dead one's path
        assert live_proc.poll() is None
        assert aside_entries(disk_dir) == []
    finally:
        live_proc.terminate()
        live_proc.wait()


@pytest.mark.parametrize("point", ["reclaim-aside", "reclaim-delete"])
def test_a_reclaimer_killed_mid_delete_is_finished_by_the_next_pass(disk_dir, point):
    dead = dead_owner(disk_dir, job="job")
    killed = greenroom("reclaim", disk_dir, env={"GREENROOM_TEST_KILL_AT": point})
    assert killed.returncode == -signal.SIGKILL
    assert not os.path.exists(dead)
    [left] = aside_entries(disk_dir)  # the killed pass's aside dir, half deleted
    later = greenroom("reclaim", disk_dir, check_rc=0)
    assert f"reclaimed: {left}" in later.stdout and "left by an interrupted delete" in later.stdout
    assert os.listdir(disk_dir) == ["job"] or os.listdir(disk_dir) == []
    assert aside_entries(disk_dir) == []


def test_an_aside_symlink_is_unlinked_never_followed(disk_dir, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    (outside / "precious").write_text("keep me")
    os.symlink(str(outside), os.path.join(disk_dir, f"{TRASH_PREFIX}0123456789ab"))
    report = reclaim(disk_dir)
    assert [d.action for d in report.decisions] == ["reclaimed"]
    assert aside_entries(disk_dir) == []
    assert (outside / "precious").read_text() == "keep me"


def test_an_aside_dir_another_reclaimer_is_deleting_is_left_to_it(disk_dir):
    aside = os.path.join(disk_dir, f"{TRASH_PREFIX}0123456789ab")
    os.makedirs(os.path.join(aside, "offload"))
    with open(os.path.join(aside, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as the reclaimer deleting it holds it
        assert reclaim(disk_dir).decisions == []
        assert os.path.isdir(os.path.join(aside, "offload"))
    assert [d.action for d in reclaim(disk_dir).decisions] == ["reclaimed"]
    assert not os.path.exists(aside)


@pytest.mark.parametrize("age", ["nan", "inf", "-1", "-inf"])
def test_min_age_must_be_finite_and_not_negative(disk_dir, age):
    dead = dead_owner(disk_dir)
    line = one_line_error(greenroom("reclaim", disk_dir, f"--min-age={age}"))
    assert "--min-age must be a finite number of seconds >= 0" in line
    assert os.path.isdir(dead)


def test_reclaim_removing_the_parent_a_starting_trainer_is_populating_never_breaks_it(disk_dir, tmp_path_factory):
    """The chart starts init containers and trainers together: the trainer stops between
    making ``<job>/<role>`` and its rank dir in it; reclaim then removes a dead sibling
    rank's dir and the then empty parents. The trainer does not die with a
    FileNotFoundError traceback: it makes the path again and runs."""
    dead = dead_owner(disk_dir, job="job", rank=1)
    trainer = greenroom_stopped_at(  # it made <job>/<role>, not yet its rank dir
        "rankdir-parents",
        "train",
        "--offload-train",
        "--offload-train-target",
        "disk",
        "--offload-train-disk-dir",
        disk_dir,
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
        "--metrics",
        str(tmp_path_factory.mktemp("m") / "m.jsonl"),
        env={**env(), "GREENROOM_JOB_ID": "job"},
    )
    swept = greenroom("reclaim", disk_dir, check_rc=0)
    assert f"reclaimed: {dead}" in swept.stdout
    assert not os.path.exists(os.path.join(disk_dir, "job")), "reclaim removed the empty parents"
    os.kill(trainer.pid, signal.SIGCONT)
    out, err = trainer.communicate(timeout=300)
    assert trainer.returncode == 0 and "Traceback" not in err, err
    assert "iter   1/1" in out
    assert os.listdir(disk_dir) == []


def test_entries_removed_by_someone_else_mid_delete_are_no_error(disk_dir):
    """A rank removing its dir with rmtree (a close that falls back to it does), through
    fds, while a reclaimer that found the dir without its lock file deletes the same
    entries: whichever of the two comes second finds them gone, and reclaim must not say
    "error: No such file or directory" and exit 1 (a Slurm epilog would log a failure). Both
    want the dir gone: an entry that is gone already is not an error."""
    dead = dead_owner(disk_dir, job="job")
    for name in ("a", "b", "c"):  # three subdirs: whichever the listing meets first, more follows it
        os.makedirs(os.path.join(dead, name))
        with open(os.path.join(dead, name, "f"), "wb") as f:
            f.write(b"x" * 4096)
    reclaimer = greenroom_stopped_at("reclaim-delete", "reclaim", disk_dir)  # the first subdir deleted
    try:
        [aside] = aside_entries(disk_dir)
        for entry in os.scandir(aside):  # what the owner's rmtree would remove meanwhile
            if entry.name != ".lock":
                subprocess.run(["rm", "-rf", entry.path], check=True)
    finally:
        os.kill(reclaimer.pid, signal.SIGCONT)
        out, err = reclaimer.communicate(timeout=120)
    assert reclaimer.returncode == 0, out + err
    assert "error: " not in out and aside_entries(disk_dir) == [] and not os.path.exists(dead)


def _holder_stopped_in_close(disk_dir):
    """A rank (a real process) stopped in its close: files deleted, lock file not yet."""
    from tests.dirs.test_rankdir import HOLDER

    holder = subprocess.Popen(
        [sys.executable, HOLDER, disk_dir, "job", "actor", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "GREENROOM_TEST_STOP_AT": "rankdir-close"},
    )
    path = holder.stdout.readline().strip()
    assert path, "holder did not start"
    holder.send_signal(signal.SIGTERM)
    assert os.WIFSTOPPED(wait_stopped(holder, "the holder sent SIGTERM")), "the holder exited before it closed its dir"
    return holder, path


def test_a_rank_closing_its_dir_keeps_it_locked_to_the_end(disk_dir):
    """A rank's close renames its dir aside and deletes its lock file last (as a
    reclaimer does): stopped after its files are gone, the aside dir is still locked and a
    reclaim leaves it alone. An rmtree that unlinked the lock file at any point would let a
    reclaimer that came then find an unlocked dir with an owner record and delete beside it."""
    holder, path = _holder_stopped_in_close(disk_dir)
    try:
        [aside] = aside_entries(disk_dir)
        assert not os.path.exists(path) and os.listdir(aside) == [".lock"]  # its files gone, its lock file last
        assert reclaim(disk_dir).decisions == [] and os.listdir(aside) == [".lock"]
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        holder.communicate(timeout=60)
    assert not os.path.exists(os.path.join(disk_dir, "job")) and aside_entries(disk_dir) == []


def test_a_successor_starting_while_its_predecessor_closes_keeps_its_dir(disk_dir):
    """An elastic restart: the new rank (same job, role and rank) starts while the old one
    is still closing. It finds the path free at once and owns it whole: the old rank's
    close finishes in its aside dir and never touches the successor's files."""
    holder, path = _holder_stopped_in_close(disk_dir)
    try:
        successor = RankDir(disk_dir, job="job", role="actor", rank=0).open()
        assert successor.path == path
        with open(os.path.join(successor.subdir("offload"), "state.bin"), "wb") as f:
            f.write(b"successor")
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        holder.communicate(timeout=60)
    assert holder.returncode != 0 and aside_entries(disk_dir) == []
    with open(os.path.join(path, "offload", "state.bin"), "rb") as f:
        assert f.read() == b"successor"
    assert sorted(os.listdir(path)) == [".lock", "offload", "owner.json"]
    successor.close()
    assert not os.path.exists(os.path.join(disk_dir, "job"))


def test_a_successor_opening_in_the_last_instant_of_a_close_keeps_its_dir(disk_dir, monkeypatch):
    """The instant that lost a successor's dir: deleted in place, a closing rank unlinked
    its lock file and then removed the dir; a successor that opened the path between the
    two made a fresh lock file and its files, the removal failed on them, and the close's
    fallback rmtree deleted them under it. Here the successor opens at the close's first
    directory removal after its files (in the same process: the instant is microseconds
    wide between two processes)."""
    first = RankDir(disk_dir, job="job", role="actor", rank=0).open()
    with open(os.path.join(first.subdir("offload"), "state.bin"), "wb") as f:
        f.write(b"first")
    real_rmdir, opened = os.rmdir, []

    def rmdir_opening_a_successor(target, *args, **kwargs):
        if not opened and os.path.basename(target) != "offload":
            opened.append(None)  # before opening: the successor's own set-up removes dirs too
            opened[0] = RankDir(disk_dir, job="job", role="actor", rank=0).open()
            with open(os.path.join(opened[0].subdir("offload"), "state.bin"), "wb") as f:
                f.write(b"successor")
        return real_rmdir(target, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", rmdir_opening_a_successor)
    first.close()
    monkeypatch.setattr(os, "rmdir", real_rmdir)
    [successor] = opened
    with open(os.path.join(successor.path, "offload", "state.bin"), "rb") as f:
        assert f.read() == b"successor"
    assert sorted(os.listdir(successor.path)) == [".lock", "offload", "owner.json"]
    assert aside_entries(disk_dir) == []
    successor.close()
    assert not os.path.exists(os.path.join(disk_dir, "job"))


def test_a_rank_killed_mid_close_is_finished_by_the_next_reclaim(disk_dir):
    holder, path = _holder_stopped_in_close(disk_dir)
    holder.kill()
    holder.communicate(timeout=60)
    [aside] = aside_entries(disk_dir)
    report = reclaim(disk_dir)
    decisions = [(d.path, d.action, d.reason) for d in report.decisions]
    assert decisions == [(aside, "reclaimed", "left by an interrupted delete")]
    assert aside_entries(disk_dir) == [] and not os.path.exists(path)
