"""The janitor against real dirs and real lock-holding processes."""

import json
import os
import signal
import subprocess
import sys
import threading

from greenroom.dirs.reclaim import TRASH_PREFIX, reclaim
from tests.cli_support import greenroom
from tests.dirs.test_rankdir import HOLDER, start_holder


def dead_owner(root, job="dead", rank=0):
    """A rank dir whose owner was SIGKILLed: no cleanup ran, the lock is free."""
    proc, path = start_holder(root, job=job, rank=rank)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert os.path.isdir(path)
    return path


def test_dead_owner_is_reclaimed_live_owner_is_kept(disk_dir):
    dead = dead_owner(disk_dir)
    live_proc, live = start_holder(disk_dir, job="live")
    try:
        report = reclaim(disk_dir)
        assert [d.path for d in report.reclaimed] == [dead]
        assert report.bytes_freed >= 65536
        assert not os.path.exists(dead) and not os.path.exists(os.path.join(disk_dir, "dead"))
        assert os.path.exists(os.path.join(live, "offload", "state.bin"))
        kept = [d for d in report.decisions if d.action == "kept"]
        assert kept[0].path == live and kept[0].reason == "locked by a live process"
    finally:
        live_proc.terminate()
        live_proc.wait()


def test_dirs_without_owner_record_are_never_touched(disk_dir):
    os.makedirs(os.path.join(disk_dir, "someone", "data"))
    open(os.path.join(disk_dir, "someone", "data", "precious"), "w").write("keep me")
    report = reclaim(disk_dir)
    assert report.decisions == []
    assert os.path.exists(os.path.join(disk_dir, "someone", "data", "precious"))


def test_a_dir_that_holds_an_owner_json_greenroom_did_not_write_is_kept_and_reported(disk_dir):
    """Only a ``<job>/<role>/rank<N>`` dir whose record names that job, role and rank is
    greenroom's: a user's ``owner.json`` (their own fields, not JSON, or greenroom-like
    fields that name another dir) keeps its dir, and the reason is in the report."""
    records = {
        os.path.join("alice", "webapp"): json.dumps({"team": "infra"}),
        os.path.join("bob", "notes"): "not json {",
        os.path.join("job", "actor", "rank00000"): json.dumps({"job": "job", "role": "actor", "rank": 1, "pid": 1}),
        os.path.join("job", "actor", "rank00002"): json.dumps({"job": "other", "role": "actor", "rank": 2}),
        os.path.join("job", "critic", "ranks"): json.dumps({"job": "job", "role": "critic", "rank": 0}),
    }
    for rel, text in records.items():
        os.makedirs(os.path.join(disk_dir, rel))
        with open(os.path.join(disk_dir, rel, "owner.json"), "w") as f:
            f.write(text)
        with open(os.path.join(disk_dir, rel, "precious"), "w") as f:
            f.write("keep me")
    report = reclaim(disk_dir)
    assert sorted(d.path for d in report.decisions) == sorted(os.path.join(disk_dir, rel) for rel in records)
    assert all(d.action == "kept" and d.reason.startswith("not a greenroom rank dir") for d in report.decisions)
    for rel, text in records.items():
        with open(os.path.join(disk_dir, rel, "owner.json")) as f:
            assert f.read() == text
        assert os.path.exists(os.path.join(disk_dir, rel, "precious"))


def test_symlinks_are_not_followed(disk_dir, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside")
    victim = dead_owner(str(outside), job="victim")  # a stale-looking dir outside ROOT
    root = os.path.join(disk_dir, "root")
    os.makedirs(root)
    os.symlink(str(outside), os.path.join(root, "link"))
    os.symlink(victim, os.path.join(root, "rank-link"))
    report = reclaim(root)
    assert report.decisions == []
    assert os.path.exists(os.path.join(victim, "offload", "state.bin"))


def test_min_age_and_dry_run(disk_dir):
    dead = dead_owner(disk_dir)
    young = reclaim(disk_dir, min_age=3600)
    assert young.reclaimed == [] and "younger than --min-age" in young.decisions[0].reason
    dry = reclaim(disk_dir, dry_run=True)
    assert [d.action for d in dry.decisions] == ["would-reclaim"] and os.path.isdir(dead)


def test_concurrent_reclaimers_reclaim_each_dir_once(disk_dir):
    dead = [dead_owner(disk_dir, job=f"dead{i}", rank=i) for i in range(6)]
    reports, failures = [], []

    def reclaimer():
        try:
            reports.append(reclaim(disk_dir))
        except BaseException as e:  # a thread's exception would otherwise only warn
            failures.append(e)

    threads = [threading.Thread(target=reclaimer) for _ in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "greenroom.cli.main", "reclaim", disk_dir, "--json"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outputs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert failures == []
    assert all(p.returncode == 0 for p in procs)
    reclaimed = [d.path for r in reports for d in r.reclaimed]
    reclaimed += [d["path"] for o in outputs for d in o["decisions"] if d["action"] == "reclaimed"]
    assert sorted(reclaimed) == sorted(dead)
    assert os.listdir(disk_dir) == []


def test_cli_reports_bytes_and_json(disk_dir):
    dead_owner(disk_dir)
    dry = greenroom("reclaim", disk_dir, "--dry-run", check_rc=0)
    assert "would-reclaim:" in dry.stdout and "would free" in dry.stdout
    out = greenroom("reclaim", disk_dir, "--json", check_rc=0)
    report = json.loads(out.stdout)
    assert report["reclaimed"] == 1 and report["bytes_freed"] >= 65536


def test_cli_missing_root_is_an_error_unless_missing_ok_and_a_file_root_is_an_error(disk_dir):
    missing = greenroom("reclaim", os.path.join(disk_dir, "never-created"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    greenroom("reclaim", "--missing-ok", os.path.join(disk_dir, "never-created"), check_rc=0)
    path = os.path.join(disk_dir, "file")
    open(path, "w").close()
    proc = greenroom("reclaim", path)
    assert proc.returncode == 2 and "is not a directory" in proc.stderr and "Traceback" not in proc.stderr


def test_a_users_empty_job_and_role_dirs_survive_reclaim(disk_dir):
    """A dead rank in a ``<job>`` the user made beforehand (their prolog's
    ``ROOT/$SLURM_JOB_ID``), and one in a ``<job>/<role>`` they made: reclaim removes the
    rank dirs and what greenroom made above them, never the user's dirs: not every empty
    dir above a reclaimed one, up to ROOT."""
    os.makedirs(os.path.join(disk_dir, "theirs"))
    os.makedirs(os.path.join(disk_dir, "their-role", "actor"))
    dead = [dead_owner(disk_dir, job=job) for job in ("theirs", "their-role", "ours")]
    report = reclaim(disk_dir)
    assert sorted(d.path for d in report.reclaimed) == sorted(dead)
    assert sorted(os.listdir(disk_dir)) == ["their-role", "theirs"]
    assert os.listdir(os.path.join(disk_dir, "theirs")) == []  # the role dir greenroom made went
    assert os.listdir(os.path.join(disk_dir, "their-role")) == ["actor"]
    assert os.listdir(os.path.join(disk_dir, "their-role", "actor")) == []


def test_the_parents_a_rank_killed_mid_close_left_are_removed_by_reclaim(disk_dir):
    """A rank SIGKILLed in its close (its dir renamed aside, its files deleted) leaves the
    aside dir in ``<job>/<role>``, which greenroom made. The next reclaim finishes the aside
    dir and then removes those parents, holding only their markers by then, rather than
    leave them, empty, for good."""
    holder = subprocess.Popen(
        [sys.executable, HOLDER, disk_dir, "job", "actor", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "GREENROOM_TEST_KILL_AT": "rankdir-close"},
    )
    path = holder.stdout.readline().strip()
    assert path, "holder did not start"
    holder.send_signal(signal.SIGTERM)
    holder.communicate(timeout=60)
    assert holder.returncode == -signal.SIGKILL
    role = os.path.dirname(path)
    [aside] = [os.path.join(role, n) for n in os.listdir(role) if n.startswith(TRASH_PREFIX)]
    report = reclaim(disk_dir)
    assert [(d.path, d.action) for d in report.decisions] == [(aside, "reclaimed")]
    assert os.listdir(disk_dir) == []
