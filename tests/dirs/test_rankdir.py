"""Per-rank dir lifetime: layout, permissions, owner record, exclusive lock, removal at exit."""

import json
import os
import signal
import stat
import subprocess
import sys

import pytest

from greenroom.dirs.names import rank_dir_path
from greenroom.dirs.rankdir import RankDir
from greenroom.errors import StorageError

HOLDER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "rank_holder.py")


def start_holder(root, job="job1", role="actor", rank=0):
    proc = subprocess.Popen([sys.executable, HOLDER, root, job, role, str(rank)], stdout=subprocess.PIPE, text=True)
    path = proc.stdout.readline().strip()
    assert path, "holder did not start"
    return proc, path


def test_layout_permissions_and_owner_record(disk_dir):
    with RankDir(disk_dir, job="j42", role="critic", rank=3) as rd:
        assert rd.path == os.path.join(disk_dir, "j42", "critic", "rank00003")
        assert stat.S_IMODE(os.stat(rd.path).st_mode) == 0o700
        owner_path = os.path.join(rd.path, "owner.json")
        assert stat.S_IMODE(os.stat(owner_path).st_mode) == 0o600
        owner = json.load(open(owner_path))
        assert owner["pid"] == os.getpid() and owner["job"] == "j42" and owner["role"] == "critic"
        assert {"host", "boot_id", "start_time", "rank"} <= owner.keys()
    assert not os.path.exists(os.path.join(disk_dir, "j42"))


def test_start_wipes_what_an_earlier_run_left(disk_dir):
    path = rank_dir_path(disk_dir, "j", "actor", 0)
    os.makedirs(os.path.join(path, "offload"))
    open(os.path.join(path, "offload", "stale.bin"), "wb").write(b"old")
    with RankDir(disk_dir, job="j", rank=0) as rd:
        assert sorted(os.listdir(rd.path)) == [".lock", "owner.json"]


def test_two_models_of_one_job_never_share_a_dir(disk_dir):
    with RankDir(disk_dir, job="j", role="actor") as actor, RankDir(disk_dir, job="j", role="critic") as critic:
        assert actor.path != critic.path


def test_a_second_owner_of_the_same_dir_is_refused(disk_dir):
    proc, path = start_holder(disk_dir)
    try:
        with pytest.raises(StorageError, match=r"is held by a live process \(pid \d+ on .*\)"):
            RankDir(disk_dir, job="job1", rank=0).open()
        assert os.path.exists(os.path.join(path, "offload", "state.bin")), "the live owner's files were touched"
    finally:
        proc.terminate()
        proc.wait()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_removes_the_dir(disk_dir, signum):
    proc, path = start_holder(disk_dir)
    assert os.path.isdir(path)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=30)
    assert "cleanup" in out
    assert not os.path.exists(path)
    assert os.listdir(disk_dir) == []


def test_exception_removes_the_dir(disk_dir):
    with pytest.raises(RuntimeError):
        with RankDir(disk_dir, job="j") as rd:
            path = rd.path
            raise RuntimeError("trainer crashed")
    assert not os.path.exists(path)


@pytest.mark.parametrize("bad", ["", "a/b", ".."])
def test_bad_job_or_role_names_are_refused(disk_dir, bad):
    with pytest.raises(ValueError, match="is not a valid directory name"):
        RankDir(disk_dir, job="j", role=bad)


def test_the_root_and_existing_parents_keep_their_mode_and_only_new_dirs_get_0700(disk_dir):
    root = os.path.join(disk_dir, "shared")
    os.makedirs(os.path.join(root, "j", "actor"))
    for path, mode in ((root, 0o1777), (os.path.join(root, "j"), 0o755), (os.path.join(root, "j", "actor"), 0o750)):
        os.chmod(path, mode)
    with RankDir(root, job="j", role="actor") as rd, RankDir(root, job="j2", role="critic") as other:
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o1777
        assert stat.S_IMODE(os.stat(os.path.join(root, "j")).st_mode) == 0o755
        assert stat.S_IMODE(os.stat(os.path.join(root, "j", "actor")).st_mode) == 0o750
        for made in (os.path.join(root, "j2"), os.path.join(root, "j2", "critic"), rd.path, other.path):
            assert stat.S_IMODE(os.stat(made).st_mode) == 0o700, made
    # The user's <job>/<role> stay, empty and with their modes; the dirs greenroom made go.
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o1777 and os.listdir(root) == ["j"]
    assert os.listdir(os.path.join(root, "j")) == ["actor"] and os.listdir(os.path.join(root, "j", "actor")) == []
    assert stat.S_IMODE(os.stat(os.path.join(root, "j", "actor")).st_mode) == 0o750
    missing = os.path.join(disk_dir, "new", "root")
    umask = os.umask(0o022)
    try:
        with RankDir(missing, job="j"):
            assert stat.S_IMODE(os.stat(missing).st_mode) == 0o755, "a missing root is made with the default mode"
    finally:
        os.umask(umask)


@pytest.mark.parametrize("first", [0, 1], ids=["rank0-closes-first", "rank1-closes-first"])
@pytest.mark.parametrize("users", ["job", os.path.join("job", "actor")])
def test_the_last_rank_to_leave_removes_the_parents_greenroom_made_and_only_those(disk_dir, users, first):
    """Two ranks of each of two jobs; one job's ``<job>`` (or ``<job>/<role>``) the user made
    beforehand, empty (their prolog's ``ROOT/$SLURM_JOB_ID``). Whichever rank closes first,
    the last one removes the dirs greenroom made and leaves the user's, empty and as they
    were: close does not ``rmdir`` every empty parent, the user's too."""
    os.makedirs(os.path.join(disk_dir, users))
    ranks = {job: [RankDir(disk_dir, job=job, rank=r).open() for r in (0, 1)] for job in ("job", "ours")}
    # Nothing of greenroom's (no marker) in the user's dir beside what it made there.
    expected = ["actor"] if users == "job" else ["rank00000", "rank00001"]
    assert sorted(os.listdir(os.path.join(disk_dir, users))) == expected
    for job, (rank0, rank1) in ranks.items():
        earlier, later = (rank0, rank1) if first == 0 else (rank1, rank0)
        earlier.close()
        assert os.path.isdir(os.path.dirname(later.path)), "a live rank's role dir was removed"
        later.close()
    assert os.listdir(disk_dir) == ["job"]
    assert sorted(
        os.path.relpath(os.path.join(d, n), disk_dir) for d, dirs, files in os.walk(disk_dir) for n in dirs + files
    ) == sorted({"job", users})


def test_a_rank_starting_in_the_parent_a_closing_rank_removes_keeps_it_and_the_last_close_removes_it(
    disk_dir, monkeypatch
):
    """A rank opens its dir in ``<job>/<role>`` at the instant a closing sibling has taken
    the dir's marker away and not yet removed it: the ``rmdir`` fails on the new rank dir,
    the marker goes back, and the new rank's close removes both parents (``greenroom.dirs.tree``
    Note [made parents])."""
    from greenroom.dirs import names

    first = RankDir(disk_dir, job="job", rank=0).open()
    role = os.path.dirname(first.path)
    real_rmdir, opened = os.rmdir, []

    def rmdir_opening_a_sibling(target, *args, **kwargs):
        if target == role and not opened:
            assert names.MADE_NAME not in os.listdir(role)
            opened.append(RankDir(disk_dir, job="job", rank=1).open())
        return real_rmdir(target, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", rmdir_opening_a_sibling)
    first.close()
    monkeypatch.setattr(os, "rmdir", real_rmdir)
    [sibling] = opened
    assert sorted(os.listdir(role)) == [names.MADE_NAME, "rank00001"]
    sibling.close()
    assert os.listdir(disk_dir) == []
