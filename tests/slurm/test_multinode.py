"""Jobs across hosts on the local three-host Slurm cluster (scripts/services.d/slurm.sh):
node1 and node2 are slurmds in their own network namespaces, each with its own address
on a veth bridge, its own hostname and its own "node-local NVMe" (the same path,
``.run/slurm/nvme``, is a different dir on each node). Every job here is a real
``greenroom train`` with disk offload and streaming under the shipped template or submitit.

Each multi-node result is compared with torch.equal to the same 2-rank job run on the one
node ``localhost`` (partition debug). Waits poll the cluster or the filesystem with a
generous deadline; nothing asserts on how long anything took.
"""

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid

import pytest
import yaml

from greenroom.slurm import sbatch
from greenroom.slurm.config import config_from_dict
from greenroom.train import rotation
from tests.cli_support import REPO, greenroom
from tests.slurm.support import CLUSTER, SUBMITTED, cancel_leftover_jobs, local_cluster, set_ranks_nice
from tests.slurm.test_cluster import job_data, logs, wait_done, wait_for
from tests.train.test_loop import assert_same_state, load_state

pytestmark = pytest.mark.slurm

NVME = os.path.join(CLUSTER, "nvme")  # what every host sees as its own node-local disk
NODES = ("node1", "node2")
SERVICE = os.path.join(REPO, "scripts", "services.d", "slurm.sh")
FOREVER = 1_000_000
ITERATIONS = 12  # long enough to see both nodes' rank dirs, and to lose one, mid-run
__all__ = ["cancel_leftover_jobs"]  # the autouse fixture, imported for the tests below


def node_disk(node: str) -> str:
    """Where ``node``'s NVMe dir is seen from this host (outside the node's namespaces)."""
    return os.path.join(CLUSTER, "nodes", node, "nvme") if node in NODES else NVME


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """The multi-node partition of the local cluster, or a skip saying why it is not there."""
    yield from local_cluster(
        os.path.join(CLUSTER, "multi"),
        "the local cluster has no namespaced nodes: `make test` "
        "starts them as root where network namespaces work (scripts/services.d/slurm.sh)",
        "-h",
        "-N",
        "-p",
        "multi",
        "-o",
        "%N %T",
    )


@pytest.fixture
def scratch():
    """A fresh scratch dir under the node-local path, made on every host's own disk."""
    sub = f"t-{uuid.uuid4().hex[:10]}"
    made = [os.path.join(node_disk(n), sub) for n in ("localhost", *NODES)]
    for path in made:
        os.makedirs(path)
    yield os.path.join(NVME, sub)
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def multi_job(tmp_path, scratch: str, name: str, *, nodes: int = 2, iterations: int = ITERATIONS, **over) -> dict:
    """2 nodes x 1 torchrun task (partition multi), or the same 2 ranks on localhost."""
    data = job_data(
        tmp_path,
        scratch,
        name,
        iterations=iterations,
        launcher="torchrun",
        torchrun=f"{sys.executable} -m torch.distributed.run",
        **over,
    )
    # torchrun sets OMP_NUM_THREADS=1 only where it starts more than one process per node:
    # the same intra-op thread count everywhere, or the sums inside a matmul differ.
    data.update(scratch_dir=scratch, nodes=nodes, tasks_per_node=2 // nodes, env={"OMP_NUM_THREADS": "1"})
    if nodes > 1:
        data["partition"] = "multi"
    data["train"]["checkpoint_dir"] = str(tmp_path / f"{name}-ckpt")
    return data


def submit(tmp_path, data: dict) -> str:
    path = tmp_path / f"{data['job_name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    job = greenroom("slurm", "submit", str(path), check_rc=0, cwd=str(tmp_path)).stdout.strip()
    assert job.isdigit(), job
    SUBMITTED.append(job)
    return job


def job_root(scratch: str, node: str, job: str) -> str:
    return os.path.join(node_disk(node), os.path.basename(scratch), f"greenroom_train_offload_{os.getuid()}", job)


def node_rank_dirs(scratch: str, node: str, job: str) -> list[str]:
    return sorted(glob.glob(os.path.join(job_root(scratch, node, job), "actor", "rank*")))


def wait_each_node_holds_a_rank(tmp_path, scratch: str, name: str, job: str, subdirs=("offload", "optim")):
    """Until node1 and node2 each hold one live rank dir on their own disk; returns
    {node: rank dir name}."""

    def holding(d: str) -> bool:
        return os.path.exists(os.path.join(d, "owner.json")) and all(
            os.path.isdir(os.path.join(d, s)) and os.listdir(os.path.join(d, s)) for s in subdirs
        )

    def ready() -> bool:
        return all(
            len(node_rank_dirs(scratch, n, job)) == 1 and holding(node_rank_dirs(scratch, n, job)[0]) for n in NODES
        )

    wait_for(f"job {job}'s rank dirs on {' and '.join(NODES)}", ready, explain=lambda: logs(tmp_path, name, job))
    return {n: os.path.basename(node_rank_dirs(scratch, n, job)[0]) for n in NODES}


def assert_completed(tmp_path, name: str, job: str, restarts: str = "0") -> str:
    info = wait_done(tmp_path, name, job)
    text = logs(tmp_path, name, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text
    assert info["Restarts"] == restarts, text
    return text


def assert_same_checkpoint(a: str, b: str) -> None:
    """Both ranks' model and optimizer state, torch.equal (the streamed optimizer state is
    compared as its files, the same bytes, but for generation.json: a fresh id per save)."""
    for rank in (0, 1):
        assert_same_state(load_state(a, rank), load_state(b, rank))
        optim_a, optim_b = (os.path.join(rotation.candidates(d)[0], f"rank{rank:05d}", "optim") for d in (a, b))
        names = sorted(set(os.listdir(optim_a)) - {"generation.json"})
        assert any(n.startswith("bucket-") for n in names), names
        assert names == sorted(set(os.listdir(optim_b)) - {"generation.json"})
        for name in names:
            with open(os.path.join(optim_a, name), "rb") as fa, open(os.path.join(optim_b, name), "rb") as fb:
                assert fa.read() == fb.read(), (rank, name)


@pytest.fixture(scope="module")
def one_node_reference(tmp_path_factory):
    """The same 2-rank job on one node (localhost), ITERATIONS long: its checkpoint."""
    tmp_path = tmp_path_factory.mktemp("reference")
    scratch = os.path.join(NVME, f"t-{uuid.uuid4().hex[:10]}")
    os.makedirs(scratch)
    try:
        job = submit(tmp_path, multi_job(tmp_path, scratch, "ref", nodes=1))
        assert_completed(tmp_path, "ref", job)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return str(tmp_path / "ref-ckpt")


# -- 1. torchrun across two hosts ----------------------------------------------------------


def test_torchrun_across_two_nodes_each_rank_on_its_own_disk_bit_identical_to_one_node(
    tmp_path, scratch, one_node_reference
):
    job = submit(tmp_path, multi_job(tmp_path, scratch, "mn"))
    held = wait_each_node_holds_a_rank(tmp_path, scratch, "mn", job)
    assert sorted(held.values()) == ["rank00000", "rank00001"]
    for node, rank in held.items():
        # Each rank's record says the host it ran on: the node's own hostname.
        with open(os.path.join(node_rank_dirs(scratch, node, job)[0], "owner.json"), encoding="utf-8") as f:
            assert yaml.safe_load(f)["host"] == node
    text = assert_completed(tmp_path, "mn", job)
    assert "2 rank(s), offload disk" in text and "streaming on" in text, text
    assert f"iter {ITERATIONS:>3}/{ITERATIONS}" in text, text
    for node in NODES:
        assert not os.path.exists(job_root(scratch, node, job)), f"{node}: per-rank files left after the job"
    assert_same_checkpoint(one_node_reference, str(tmp_path / "mn-ckpt"))


# -- 2. per-node reclaim ------------------------------------------------------------------


def in_node(node: str, argv: list[str], **kwargs) -> subprocess.Popen:
    """Start ``argv`` on ``node``: in its slurmd's network, mount and UTS namespaces."""
    with open(os.path.join(CLUSTER, f"slurmd-{node}.pid"), encoding="ascii") as f:
        slurmd = f.read().strip()
    return subprocess.Popen(["nsenter", f"--target={slurmd}", "--net", "--mount", "--uts", *argv], **kwargs)


def plant_dead_rank_dir(scratch: str, node: str, job: str, rank: int) -> str:
    """A rank dir on ``node``'s disk whose owner died: a real process on the node takes it,
    then is SIGKILLed (no cleanup runs). Returns its path as the node sees it."""
    root = os.path.join(scratch, f"greenroom_train_offload_{os.getuid()}")
    holder = in_node(
        node,
        [sys.executable, os.path.join(REPO, "tests", "rank_holder.py"), root, job, "actor", str(rank)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.path.join(REPO, "runtime")},
    )
    path = holder.stdout.readline().strip()
    holder.send_signal(signal.SIGKILL)  # nsenter execs the holder: this is the holder itself
    holder.wait()
    holder.stdout.close()
    return path


def test_setup_step_reclaims_a_dead_rank_dir_on_node2_and_keeps_node1s_live_dirs(tmp_path, scratch):
    # Live: a one-node job running on node1 all along, its rank dir on node1's disk.
    live_data = job_data(
        tmp_path,
        scratch,
        "live",
        iterations=FOREVER,
        streaming=False,
        nodes=1,
        tasks_per_node=1,
        partition="multi",
        sbatch_extra={"nodelist": "node1"},
    )
    live_data["scratch_dir"] = scratch
    live = submit(tmp_path, live_data)
    wait_for(
        "the live job's rank dir on node1",
        lambda: any(os.path.exists(os.path.join(d, "owner.json")) for d in node_rank_dirs(scratch, "node1", live)),
        explain=lambda: logs(tmp_path, "live", live),
    )
    live_dirs = node_rank_dirs(scratch, "node1", live)
    set_ranks_nice(live_dirs, 19)  # alive and training, at the lowest CPU priority until its cancel

    # Dead: rank 1 of an earlier job, killed on node2.
    dead = plant_dead_rank_dir(scratch, "node2", "4242", 1)
    assert node_rank_dirs(scratch, "node2", "4242") == [
        os.path.join(job_root(scratch, "node2", "4242"), "actor", "rank00001")
    ]

    job = submit(tmp_path, multi_job(tmp_path, scratch, "reclaim", iterations=2))
    text = assert_completed(tmp_path, "reclaim", job)
    # node2's reclaim step removed the dead dir (its record names node2) ...
    assert re.search(rf"^reclaimed: {re.escape(dead)} .*\(job 4242, pid \d+ on node2\): owner gone$", text, re.M), text
    assert node_rank_dirs(scratch, "node2", "4242") == []
    # ... and node1's kept the live job's (it never saw node2's disk, nor node2 node1's).
    for d in live_dirs:
        seen = d.replace(node_disk("node1"), NVME)
        assert f"kept: {seen}" in text and "locked by a live process" in text, text
    assert node_rank_dirs(scratch, "node1", live) == live_dirs
    assert sbatch.job_state(live) == "RUNNING"
    for node in NODES:
        assert not os.path.exists(job_root(scratch, node, job)), f"{node}: the job's files left after it"

    set_ranks_nice(live_dirs, 0)
    sbatch.cancel(live)
    assert wait_done(tmp_path, "live", live)["JobState"] == "CANCELLED"
    assert not os.path.exists(job_root(scratch, "node1", live))


# -- 3. a lost node -----------------------------------------------------------------------


def service(*args: str) -> None:
    subprocess.run(["bash", SERVICE, *args], check=True, capture_output=True, text=True)


def node_state(node: str) -> str:
    return subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True, text=True).stdout.strip()


def node_back(node: str) -> None:
    """Bring ``node`` back and wait until the controller takes it as idle again."""
    service("node-up", node)
    wait_for(f"{node} to return to service", lambda: node_state(node) == "idle", explain=lambda: node_state(node))


def test_lost_node_requeues_its_files_go_when_it_returns_and_the_job_resumes_bit_identically(
    tmp_path, scratch, one_node_reference
):
    # The last checkpoint: the same job, run to iteration 2.
    first = submit(tmp_path, multi_job(tmp_path, scratch, "lost", iterations=2, max_restarts=1))
    assert_completed(tmp_path, "lost", first)

    # Then on to ITERATIONS: it resumes at 3, and node2 is lost mid-run.
    job = submit(tmp_path, multi_job(tmp_path, scratch, "lost", max_restarts=1))
    wait_each_node_holds_a_rank(tmp_path, scratch, "lost", job)
    stale = node_rank_dirs(scratch, "node2", job)
    try:
        service("node-down", "node2")
        # max_restarts > 0 renders --requeue: Slurm requeues a job that loses a node once
        # it declares the node DOWN (SlurmdTimeout); the job waits for two nodes again.
        wait_for(
            f"job {job} to be requeued",
            lambda: sbatch.job_info(job).get("Restarts") == "1",
            explain=lambda: logs(tmp_path, "lost", job),
        )
        assert node_state("node2").startswith("down"), node_state("node2")
        assert node_rank_dirs(scratch, "node2", job) == stale, "a crashed node cannot clean up"
    finally:
        node_back("node2")
    text = assert_completed(tmp_path, "lost", job, restarts="1")
    # node2's reclaim step, on the requeued run's start, removed what the crash left there.
    for d in stale:
        seen = re.escape(d.replace(node_disk("node2"), NVME))
        assert re.search(rf"^reclaimed: {seen} .*\(job {job}, pid \d+ on node2\): owner gone$", text, re.M), text
    for restart in (0, 1):
        with open(tmp_path / "logs" / f"lost-{job}-r{restart}-0.out", encoding="utf-8") as f:
            assert "resuming at iteration 3" in f.read()
    for node in NODES:
        assert not os.path.exists(job_root(scratch, node, job)), f"{node}: the job's files left after it"
    assert_same_checkpoint(one_node_reference, str(tmp_path / "lost-ckpt"))


def test_lost_node_without_restarts_fails_the_job_and_the_next_job_reclaims_node2(tmp_path, scratch):
    job = submit(tmp_path, multi_job(tmp_path, scratch, "fail", iterations=FOREVER, max_restarts=0))
    wait_each_node_holds_a_rank(tmp_path, scratch, "fail", job)
    stale = node_rank_dirs(scratch, "node2", job)
    try:
        service("node-down", "node2")
        # max_restarts: 0 renders --no-requeue: the job ends NODE_FAIL (Slurm's default
        # would have requeued it).
        info = wait_done(tmp_path, "fail", job)
        assert info["JobState"] == "NODE_FAIL" and info["Restarts"] == "0", logs(tmp_path, "fail", job)
        assert node_rank_dirs(scratch, "node2", job) == stale, "a crashed node cannot clean up"
    finally:
        node_back("node2")
    # The next greenroom job on node2 reclaims what the crash left there, in its setup step.
    nxt = submit(tmp_path, multi_job(tmp_path, scratch, "after", iterations=1, max_restarts=0))
    text = assert_completed(tmp_path, "after", nxt)
    for d in stale:
        seen = re.escape(d.replace(node_disk("node2"), NVME))
        assert re.search(rf"^reclaimed: {seen} .*\(job {job}, pid \d+ on node2\): owner gone$", text, re.M), text
    for node in NODES:
        for j in (job, nxt):
            assert not os.path.exists(job_root(scratch, node, j)), f"{node}: job {j}'s files left"


# -- 4. submitit --------------------------------------------------------------------------


def test_submitit_across_two_nodes_each_rank_on_its_own_disk_bit_identical_to_one_node(
    tmp_path, scratch, one_node_reference
):
    from greenroom.slurm.submitit_api import submit_train

    data = multi_job(tmp_path, scratch, "submitit")
    data.update(launcher="srun", tasks_per_node=1)  # submitit starts one task per rank itself
    job = submit_train(config_from_dict(data), str(tmp_path / "submitit"))
    SUBMITTED.append(job.job_id)
    held = wait_each_node_holds_a_rank(tmp_path, scratch, "submitit", job.job_id)
    assert sorted(held.values()) == ["rank00000", "rank00001"]
    assert job.results() == [0, 0]
    wait_done(tmp_path, "submitit", job.job_id)
    assert sbatch.job_state(job.job_id) == "COMPLETED"
    assert f"reclaim {os.path.join(scratch, f'greenroom_train_offload_{os.getuid()}')}" in job.stdout()
    for node in NODES:
        assert not os.path.exists(job_root(scratch, node, job.job_id)), f"{node}: files left after the job"
    assert_same_checkpoint(one_node_reference, str(tmp_path / "submitit-ckpt"))


# -- 5. containers ------------------------------------------------------------------------

# apptainer is not packaged for Debian and no image can be pulled here: this stand-in keeps
# the CLI contract the template relies on (`exec [--nv] --bind SRC... IMAGE CMD...`: the
# image must exist, each bind source must exist on the node) and runs CMD on the host.
# What it checks is the template's multi-node path through the runtime, not the container.
APPTAINER_STAND_IN = """#!/bin/bash
set -euo pipefail
[ "$1" = exec ] || { echo "apptainer (stand-in): only exec" >&2; exit 2; }
shift
binds=()
while [ $# -gt 0 ]; do
  case "$1" in --nv) shift ;; --bind) binds+=("${2%%:*}"); shift 2 ;; *) break ;; esac
done
image=$1; shift
[ -f "$image" ] || { echo "apptainer (stand-in): no image $image" >&2; exit 255; }
for b in "${binds[@]}"; do [ -e "$b" ] || { echo "apptainer (stand-in): no bind source $b" >&2; exit 255; }; done
echo "$(hostname) binds=${binds[*]} cmd=$*" >>"$APPTAINER_RECORD"
exec "$@"
"""


def test_apptainer_multi_node_path_runs_reclaim_and_torchrun_through_the_runtime_on_each_node(tmp_path, scratch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apptainer").write_text(APPTAINER_STAND_IN)
    (bin_dir / "apptainer").chmod(0o755)
    image = tmp_path / "greenroom.sif"
    image.write_bytes(b"")
    record = tmp_path / "apptainer.log"
    data = multi_job(tmp_path, scratch, "apptainer", iterations=2, max_restarts=0)
    data["env"].update(PATH=f"{bin_dir}:{os.environ['PATH']}", APPTAINER_RECORD=str(record))
    data["container"] = {"runtime": "apptainer", "image": str(image)}
    job = submit(tmp_path, data)
    text = assert_completed(tmp_path, "apptainer", job)
    assert "2 rank(s), offload disk" in text and "iter   2/2" in text, text
    runs = record.read_text().splitlines()
    for node in NODES:
        mine = [r for r in runs if r.startswith(f"{node} binds={scratch} cmd=")]
        # On each node: the setup reclaim, the trainer's torchrun, the exit reclaim.
        assert [("reclaim" in r, "torch.distributed.run" in r) for r in mine] == [
            (True, False),
            (False, True),
            (True, False),
        ], runs
    for node in NODES:
        assert not os.path.exists(job_root(scratch, node, job)), f"{node}: the job's files left after it"


def test_pyxis_multi_node_script_is_accepted_by_slurm_render_only(tmp_path, scratch):
    """pyxis is a SPANK plugin inside srun (not packaged for Debian; a stand-in would have to
    be a plugin of our own), so the 2-node pyxis job is checked as far as Slurm can without
    it: rendered, and accepted by `sbatch --test-only` for node1 and node2."""
    data = multi_job(tmp_path, scratch, "pyxis", iterations=2)
    data["container"] = {"runtime": "pyxis", "image": "greenroom:test"}
    path = tmp_path / "pyxis.yaml"
    path.write_text(yaml.safe_dump(data))
    script = greenroom("slurm", "render", str(path), check_rc=0).stdout
    # Both the per-node reclaim and the per-node torchrun run in the container.
    assert script.count("--container-image=greenroom:test") == 2, script
    proc = greenroom("slurm", "submit", "--test-only", str(path), check_rc=0)
    assert "to start at" in proc.stdout and "node[1-2]" in proc.stdout, proc.stdout
