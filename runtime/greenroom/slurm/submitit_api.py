"""Submit the same job from Python with submitit, for notebooks and sweeps.

``submit_train(config, folder)`` takes the ``SlurmJobConfig`` the YAML path uses and
submits ``greenroom train`` through ``submitit.AutoExecutor``. The executor runs the
sbatch template's own environment and reclaim section (``render.setup_lines``) as its
setup, and the same ``srun --kill-on-bad-exit``, so the nodes are prepared exactly as
for ``greenroom slurm submit``. Each submitit task runs the trainer in-process with
RANK/LOCAL_RANK/WORLD_SIZE from ``submitit.JobEnvironment``::

    from greenroom.slurm.config import load_config
    from greenroom.slurm.submitit_api import submit_train

    job = submit_train(load_config("deploy/slurm/examples/single-node.yaml"), "logs/submitit")
    job.result()                     # waits; raises if a rank failed
    print(job.stdout(), job_state(job.job_id))

Preemption is submitit's own business on this path (its USR2 signal and requeue), and
containers are not supported here: use ``greenroom slurm submit`` for those.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

import submitit

from greenroom.errors import ConfigError, GreenroomError
from greenroom.slurm.config import SlurmJobConfig
from greenroom.slurm.render import program, resource_options, seed_flags, setup_lines
from greenroom.slurm.sbatch import job_state
from greenroom.slurm.values import time_minutes

__all__ = ["TrainTask", "executor_for", "submit_train", "job_state"]

# sbatch options that submitit takes as named parameters (it writes those lines itself);
# the rest of ``render.resource_options`` goes through as additional parameters.
_SUBMITIT_NAMES = {
    "job-name": "name",
    "nodes": "nodes",
    "ntasks-per-node": "tasks_per_node",
    "cpus-per-task": "cpus_per_task",
    "gpus-per-node": "gpus_per_node",
    "mem": "slurm_mem",
    "partition": "slurm_partition",
    "account": "slurm_account",
}


@dataclass(frozen=True)
class TrainTask:
    """What each submitit task runs: ``greenroom train`` with this rank's environment."""

    args: tuple[str, ...]
    """``greenroom train`` arguments: its own (``--load`` under ``--resume auto``, as the
    template's), then the seed flags."""

    def __call__(self) -> int:
        env = submitit.JobEnvironment()
        os.environ.update(RANK=str(env.global_rank), LOCAL_RANK=str(env.local_rank), WORLD_SIZE=str(env.num_tasks))
        # Exported by the setup lines on the node: the per-user root under the scratch dir.
        argv = ["train", *self.args, "--offload-train-disk-dir", os.environ["GREENROOM_OFFLOAD_ROOT"]]
        from greenroom.cli.main import main

        rc = main(argv)
        if rc:
            raise GreenroomError(f"greenroom train exited with {rc} on rank {env.global_rank}")
        return rc


def executor_for(config: SlurmJobConfig, folder: str) -> submitit.AutoExecutor:
    """An AutoExecutor with the job's resources, setup lines and srun arguments."""
    if config.container is not None:
        raise ConfigError("container: not supported through submitit; use `greenroom slurm submit`")
    if config.command is not None:
        raise ConfigError(
            "command: submitit runs greenroom train in-process; use `greenroom slurm submit` for your own trainer"
        )
    if config.launcher != "srun":
        raise ConfigError("launcher: submitit starts one task per process itself; use launcher: srun")
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    options = resource_options(config)
    named = {_SUBMITIT_NAMES[key]: options.pop(key) for key in list(options) if key in _SUBMITIT_NAMES}
    for key in ("nodes", "tasks_per_node", "cpus_per_task", "gpus_per_node"):
        if key in named:
            named[key] = int(named[key])
    executor.update_parameters(
        **named,
        timeout_min=time_minutes(options.pop("time")),
        slurm_setup=setup_lines(config),
        slurm_srun_args=["--kill-on-bad-exit=1"],
        slurm_signal_delay_s=config.preempt_signal_seconds,
        slurm_additional_parameters=options,
    )
    return executor


def submit_train(config: SlurmJobConfig, folder: str) -> submitit.Job:
    """Submit ``greenroom train`` for ``config``; the job's logs live under ``folder``."""
    own = program(config)[len(shlex.split(config.greenroom)) + 1 :]  # after `greenroom train`
    task = TrainTask(args=(*own, *seed_flags(config)))
    return executor_for(config, folder).submit(task)
