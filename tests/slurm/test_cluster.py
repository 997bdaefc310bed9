"""The rendered jobs on a real Slurm cluster (slurmctld + slurmd + munge on localhost,
started by scripts/services.d/slurm.sh): sbatch --test-only on every variant, 2-task
``greenroom train`` jobs with disk offload and streaming, a killed job's files reclaimed
by the next job while a running job's are kept, preemption and requeue, and submitit.

Waits poll the cluster or the filesystem with a generous deadline; nothing asserts on
how long anything took.
"""

import copy
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from greenroom.slurm import sbatch
from greenroom.slurm.config import config_from_dict
from tests.cli_support import REPO, greenroom
from tests.slurm.support import SLURM_CONF, SUBMITTED, cancel_leftover_jobs, local_cluster, set_ranks_nice

pytestmark = pytest.mark.slurm

DEADLINE_S = 180
FOREVER = 1_000_000  # iterations of a job that runs until it is cancelled
RUNNING = 12  # iterations of a job its test sees mid-run (its ranks' dirs, a signal) before its end
__all__ = ["cancel_leftover_jobs"]  # the autouse fixture, imported for the tests below


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """The local cluster, or a skip saying why it is not there."""
    yield from local_cluster(
        SLURM_CONF,
        f"no {SLURM_CONF}: `make test` starts the local cluster (scripts/services.d/slurm.sh)",
        "-h",
        "-N",
        "-o",
        "%T",
    )


def job_data(tmp_path, disk_dir, name: str, *, iterations: int = 2, streaming: bool = True, **over) -> dict:
    data = {
        "job_name": name,
        "tasks_per_node": 2,
        "mem": "2G",
        "time": "00:15:00",
        "scratch_dir": os.path.join(disk_dir, "scratch"),
        "log_dir": str(tmp_path / "logs"),
        "greenroom": f"{sys.executable} -m greenroom.cli.main",
        "max_restarts": 0,
        "train": {
            "offload_train": True,
            "offload_train_target": "disk",
            "offload_train_disk_chunk_mb": 1,
            "stream_optimizer_state_to_disk": streaming,
            "iterations": iterations,
            "extra_args": ["--no-progress", "--metrics", str(tmp_path / f"{name}.jsonl")],
        },
    }
    if streaming:
        # bf16 params: fp32 ones are their own masters and stay resident (nothing to stream).
        data["train"]["extra_args"] += ["--dtype", "bf16"]
    data.update(over)
    return data


def submit(tmp_path, data: dict) -> str:
    path = tmp_path / f"{data['job_name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    # cwd: Slurm's own slurm-<job>.out lands where the job is submitted from.
    proc = greenroom("slurm", "submit", str(path), check_rc=0, cwd=str(tmp_path))
    job = proc.stdout.strip()
    assert job.isdigit(), proc.stdout
    SUBMITTED.append(job)
    return job


def offload_root(disk_dir) -> str:
    return os.path.join(disk_dir, "scratch", f"greenroom_train_offload_{os.getuid()}")


def rank_dirs(disk_dir, job: str) -> list[str]:
    return sorted(glob.glob(os.path.join(offload_root(disk_dir), job, "actor", "rank*")))


def logs(tmp_path, name: str, job: str) -> str:
    out = []
    for path in sorted(glob.glob(str(tmp_path / "logs" / f"{name}-{job}*.out"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            out.append(f"== {os.path.basename(path)}\n{f.read()}")
    return "\n".join(out)


def wait_for(what: str, predicate, *, explain=lambda: ""):
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}\n{explain()}")
        time.sleep(0.2)


def wait_done(tmp_path, name: str, job: str) -> dict:
    info = {}

    def done():
        info.update(sbatch.job_info(job))
        return info.get("JobState") in sbatch.TERMINAL_STATES

    wait_for(f"job {job} to end", done, explain=lambda: logs(tmp_path, name, job))
    return info


def wait_ranks_running(
    tmp_path, disk_dir, name: str, job: str, *, ranks: int = 2, subdirs: tuple[str, ...] = ("offload",)
) -> list[str]:
    """Until every rank holds its dir with an owner record and files in each subdir (the
    optimizer's appear at its first step, after the actor first slept)."""

    def holding(d: str) -> bool:
        return os.path.exists(os.path.join(d, "owner.json")) and all(
            os.path.isdir(os.path.join(d, sub)) and os.listdir(os.path.join(d, sub)) for sub in subdirs
        )

    def ready() -> bool:
        dirs = rank_dirs(disk_dir, job)
        return len(dirs) == ranks and all(holding(d) for d in dirs)

    wait_for(f"job {job}'s {ranks} rank dirs", ready, explain=lambda: logs(tmp_path, name, job))
    return rank_dirs(disk_dir, job)


def kill_every_process(job: str) -> None:
    """SIGKILL the job's processes, the batch shell first, as a node crash or the OOM
    killer would: no trap and no exit handler runs. (``scancel --signal=KILL`` is a
    normal cancel to Slurm: SIGTERM first, so the traps would run.)"""
    proc = subprocess.run(["scontrol", "listpids", job], capture_output=True, text=True, check=True)
    rows = [line.split() for line in proc.stdout.splitlines()[1:] if line.strip()]
    for pid, _, step, *_ in sorted(rows, key=lambda row: row[2] != "batch"):
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass  # already gone with its parent


# -- sbatch --test-only -----------------------------------------------------------------


def local_variants(tmp_path, disk_dir) -> dict[str, dict]:
    """Every example plus each launcher/container/GPU shape, shrunk to fit this cluster
    (one node, two fake GPUs, the default partition, no account or QoS)."""
    base = job_data(tmp_path, disk_dir, "variant")
    variants = {}
    for path in sorted(glob.glob(os.path.join(REPO, "deploy", "slurm", "examples", "*.yaml"))):
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
        for key in ("partition", "account", "qos", "sbatch_extra"):
            data.pop(key, None)
        data.update(
            nodes=1,
            gpus_per_node=min(data.get("gpus_per_node", 0), 2),
            mem="1G",
            log_dir=base["log_dir"],
            scratch_dir=base["scratch_dir"],
        )
        # The defaults: one CPU per process (this node has 4).
        data.pop("tasks_per_node", None)
        data.pop("cpus_per_task", None)
        variants[os.path.basename(path)] = data
    for launcher in ("srun", "torchrun"):
        for gpus in (0, 2):
            for container in (None, "pyxis", "apptainer"):
                data = copy.deepcopy(base)
                data.update(
                    launcher=launcher,
                    gpus_per_node=gpus,
                    tasks_per_node=gpus or 2,
                    max_restarts=1,
                    exclusive=container == "pyxis",
                )
                if container:
                    data["container"] = {"runtime": container, "image": "greenroom:test", "mounts": ["/a:/b"]}
                variants[f"{launcher}-gpus{gpus}-{container or 'bare'}"] = data
    return variants


def test_sbatch_test_only_accepts_every_rendered_variant(tmp_path, disk_dir):
    variants = local_variants(tmp_path, disk_dir)
    assert len(variants) == 17
    for name, data in variants.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        proc = greenroom("slurm", "submit", "--test-only", str(path))
        assert proc.returncode == 0, f"{name}: {proc.stderr}"
        assert "to start at" in proc.stdout, f"{name}: {proc.stdout}"


def test_fake_gpus_reach_the_job_as_cuda_visible_devices(tmp_path):
    out = subprocess.run(
        ["srun", "--gpus-per-node=2", "--mem=100M", "bash", "-c", "echo $CUDA_VISIBLE_DEVICES"],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert out.returncode == 0 and out.stdout.strip() == "0,1", out.stderr


@pytest.mark.parametrize("launcher, cpus_per_task, step_cpus", [("torchrun", 4, 4), ("srun", 2, 4)])
def test_trainer_step_gets_the_cpus_per_task_the_config_asks(tmp_path, disk_dir, launcher, cpus_per_task, step_cpus):
    # 2 processes on the 4-CPU node. cpus_per_task is Slurm's --cpus-per-task: torchrun's one
    # task gets all 4 for its 2 processes, srun's 2 tasks get 2 each. The step must ask for
    # them itself: srun of Slurm 22.05 (this cluster's) does not inherit them from sbatch.
    out = tmp_path / "steps"
    out.mkdir()
    probe = f'scontrol show step -o "$SLURM_JOB_ID.$SLURM_STEP_ID" > {out}/"$RANK".txt'
    data = job_data(
        tmp_path,
        disk_dir,
        f"cpus-{launcher}",
        launcher=launcher,
        cpus_per_task=cpus_per_task,
        torchrun=f"{sys.executable} -m torch.distributed.run",
        command=["bash", "-c", probe],
    )
    data["train"] = {}
    job = submit(tmp_path, data)
    info = wait_done(tmp_path, f"cpus-{launcher}", job)
    text = logs(tmp_path, f"cpus-{launcher}", job)
    assert info["JobState"] == "COMPLETED", text
    assert info["NumCPUs"] == "4", info
    for rank in ("0", "1"):
        step = (out / f"{rank}.txt").read_text()
        assert re.search(r"\bCPUs=(\d+)", step)[1] == str(step_cpus), step


# -- jobs running greenroom train ---------------------------------------------------------


def test_two_task_job_with_disk_offload_and_streaming_succeeds_and_leaves_no_files(tmp_path, disk_dir):
    # Two fake GPUs: the GPU-shaped script (--gpus-per-node, its steps) runs for real; the
    # trainer itself falls back to the CPU, which has no CUDA here.
    job = submit(tmp_path, job_data(tmp_path, disk_dir, "ok", iterations=RUNNING, gpus_per_node=2))
    dirs = wait_ranks_running(tmp_path, disk_dir, "ok", job, subdirs=("offload", "optim"))
    assert [os.path.basename(d) for d in dirs] == ["rank00000", "rank00001"]
    for d in dirs:
        with open(os.path.join(d, "owner.json"), encoding="utf-8") as f:
            assert json.load(f)["job"] == job
    info = wait_done(tmp_path, "ok", job)
    text = logs(tmp_path, "ok", job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text
    assert "2 rank(s), offload disk" in text and "streaming on" in text
    assert f"iter {RUNNING:>3}/{RUNNING}" in text
    assert not os.path.exists(os.path.join(offload_root(disk_dir), job)), "per-rank dirs left after the job"


def test_torchrun_launcher_runs_one_torchrun_starting_two_ranks(tmp_path, disk_dir):
    data = job_data(
        tmp_path,
        disk_dir,
        "torchrun",
        iterations=3,
        launcher="torchrun",
        torchrun=f"{sys.executable} -m torch.distributed.run",
    )
    job = submit(tmp_path, data)
    info = wait_done(tmp_path, "torchrun", job)
    text = logs(tmp_path, "torchrun", job)
    assert info["JobState"] == "COMPLETED" and info["NumTasks"] == "1", text
    assert "2 rank(s), offload disk" in text and "streaming on" in text and "iter   3/3" in text
    assert not os.path.exists(os.path.join(offload_root(disk_dir), job))


def test_killed_jobs_files_go_at_the_next_jobs_reclaim_while_a_running_jobs_stay(tmp_path, disk_dir):
    # B: running on the same node and the same scratch root all along.
    running = submit(tmp_path, job_data(tmp_path, disk_dir, "running", iterations=FOREVER, streaming=False))
    live = wait_ranks_running(tmp_path, disk_dir, "running", running)
    set_ranks_nice(live, 19)  # alive and training, at the lowest CPU priority until its cancel

    # A: killed outright (as by a node crash or the OOM killer): no trap, no cleanup runs.
    killed = submit(tmp_path, job_data(tmp_path, disk_dir, "killed", iterations=FOREVER, streaming=False))
    stale = wait_ranks_running(tmp_path, disk_dir, "killed", killed)
    kill_every_process(killed)
    wait_done(tmp_path, "killed", killed)
    assert rank_dirs(disk_dir, killed) == stale, "the kill was meant to leave the files behind"

    # C: its reclaim step, before its trainer starts, removes A's files and keeps B's.
    nxt = submit(tmp_path, job_data(tmp_path, disk_dir, "next", streaming=False))
    info = wait_done(tmp_path, "next", nxt)
    text = logs(tmp_path, "next", nxt)
    assert info["JobState"] == "COMPLETED", text
    for d in stale:
        assert f"reclaimed: {d}" in text, text
        assert not os.path.exists(d)
    for d in live:
        assert f"kept: {d}" in text and "locked by a live process" in text, text
    assert rank_dirs(disk_dir, running) == live
    assert all(os.path.exists(os.path.join(d, "owner.json")) for d in live)
    assert sbatch.job_state(running) == "RUNNING"
    assert not os.path.exists(os.path.join(offload_root(disk_dir), nxt))

    # B cancelled the ordinary way (SIGTERM): its ranks and its exit trap clean up.
    set_ranks_nice(live, 0)
    sbatch.cancel(running)
    assert wait_done(tmp_path, "running", running)["JobState"] == "CANCELLED"
    assert not os.path.exists(os.path.join(offload_root(disk_dir), running))


def test_preemption_signal_stops_the_trainer_requeues_and_the_job_finishes(tmp_path, disk_dir):
    data = job_data(tmp_path, disk_dir, "preempt", iterations=RUNNING, streaming=True, max_restarts=1)
    job = submit(tmp_path, data)
    wait_ranks_running(tmp_path, disk_dir, "preempt", job)
    # What Slurm sends the batch shell before a preemption or the time limit (--signal=B:USR1).
    sbatch.cancel(job, signal="USR1", batch=True)
    info = wait_done(tmp_path, "preempt", job)
    text = logs(tmp_path, "preempt", job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", text
    assert "SIGUSR1 (preemption or time limit): stopping the trainer" in text
    assert f"requeueing job {job} (restart 1 of 1)" in text
    # The first run's ranks took the forwarded SIGTERM and exited (143), not SIGKILL (137).
    # Not srun's "task N: Exited with exit code 143": a full run once had the step
    # cancelled without those lines.
    first, second = text.split(f"requeueing job {job}", 1)
    assert "the trainer's step exited with code 143" in first, text
    assert "the trainer's step exited with code 0" in second, text
    # The requeued run's exit starts no reclaim step (srun: "Unable to confirm allocation").
    assert "Unable to confirm allocation" not in text, text
    # One log per task and restart; the second run went to the end.
    step_logs = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "logs" / f"preempt-{job}-r*")))
    assert step_logs == [f"preempt-{job}-r{r}-{t}.out" for r in (0, 1) for t in (0, 1)]
    with open(tmp_path / "logs" / f"preempt-{job}-r1-0.out", encoding="utf-8") as f:
        assert f"iter {RUNNING:>3}/{RUNNING}" in f.read()
    assert not os.path.exists(os.path.join(offload_root(disk_dir), job))


def test_submitit_job_runs_two_ranks_with_the_templates_setup_and_cleans_up(tmp_path, disk_dir):
    from greenroom.slurm.submitit_api import submit_train

    config = config_from_dict(job_data(tmp_path, disk_dir, "submitit", iterations=RUNNING))
    job = submit_train(config, str(tmp_path / "submitit"))
    SUBMITTED.append(job.job_id)
    wait_ranks_running(tmp_path, disk_dir, "submitit", job.job_id, subdirs=("offload", "optim"))
    assert job.results() == [0, 0]
    wait_done(tmp_path, "submitit", job.job_id)
    assert sbatch.job_state(job.job_id) == "COMPLETED"
    assert "2 rank(s), offload disk" in job.stdout() and f"iter {RUNNING:>3}/{RUNNING}" in job.stdout()
    # The setup lines ran: the pre-trainer reclaim step printed its summary.
    assert f"reclaim {os.path.realpath(offload_root(disk_dir))}" in job.stdout()
    assert not os.path.exists(os.path.join(offload_root(disk_dir), job.job_id))


def test_submitit_path_refuses_containers_with_a_one_line_error(tmp_path, disk_dir):
    from greenroom.slurm.submitit_api import executor_for

    config = config_from_dict(job_data(tmp_path, disk_dir, "c", container={"runtime": "pyxis", "image": "x"}))
    with pytest.raises(ValueError, match="^container: not supported through submitit"):
        executor_for(config, str(tmp_path / "submitit"))


# -- any trainer -------------------------------------------------------------------------


def test_hf_trainer_script_runs_as_two_tasks_from_a_plain_sbatch_of_the_rendered_file(tmp_path, disk_dir):
    """Not greenroom train: deploy/examples/hf_trainer.py (HF Trainer, StreamingAdam, the
    offloader) takes its flags from $GREENROOM_ARGS only (command: with the default
    greenroom_args auto). Rendered to a file and submitted with plain sbatch, into a log
    dir nobody created: the script makes it."""
    data = job_data(tmp_path, disk_dir, "hf")
    del data["greenroom"]
    data["log_dir"] = str(tmp_path / "not" / "yet" / "logs")
    data["train"] = {
        "offload_train": True,
        "offload_train_target": "disk",
        "offload_train_disk_chunk_mb": 1,
        "stream_optimizer_state_to_disk": True,
    }
    script = os.path.join(REPO, "deploy", "examples", "hf_trainer.py")
    data["command"] = [sys.executable, script, str(tmp_path / "out"), "--steps", "3"]
    config = tmp_path / "hf.yaml"
    config.write_text(yaml.safe_dump(data))
    greenroom("slurm", "render", str(config), "-o", str(tmp_path / "hf.sh"), check_rc=0)
    proc = subprocess.run(
        ["sbatch", "--parsable", str(tmp_path / "hf.sh")], capture_output=True, text=True, cwd=str(tmp_path)
    )
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    SUBMITTED.append(job)
    info = wait_done(tmp_path, "hf", job)
    step_logs = {}
    for t in (0, 1):
        with open(tmp_path / "not" / "yet" / "logs" / f"hf-{job}-r0-{t}.out", encoding="utf-8") as f:
            step_logs[t] = f.read()
    assert info["JobState"] == "COMPLETED", step_logs
    for t, text in step_logs.items():
        # Each task is one rank of a 2-process job, each slept and woke every step.
        assert f"rank {t} of 2" in text and "step 3: slept" in text, text
    assert os.path.exists(tmp_path / "not" / "yet" / "logs" / f"hf-{job}.out")
    assert not os.path.exists(os.path.join(offload_root(disk_dir), job)), "per-rank dirs left after the job"
