"""Render a ``SlurmJobConfig`` to an sbatch script.

The templates (``greenroom/slurm/templates/``) hold the layout and a few switches; this
module builds every value that lands in them and quotes each shell word with
``shlex.quote``, so a path with a space or a ``$`` in a user's value never changes the
script's meaning. Jinja runs with ``StrictUndefined``: a misspelt variable is an error,
not an empty string.

``setup_lines`` renders only the environment/reclaim part, which the submitit executor
(``greenroom.slurm.submitit_api``) runs as its ``slurm_setup``: both paths prepare the
nodes the same way.
"""

from __future__ import annotations

import os
import shlex

import jinja2

from greenroom.errors import ConfigError
from greenroom.slurm.config import SlurmJobConfig

TEMPLATE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")
SETUP_TEMPLATE = "_setup.sh.j2"


def shipped_templates() -> list[str]:
    return sorted(name for name in os.listdir(TEMPLATE_DIR) if name.endswith(".j2") and not name.startswith("_"))


def _quote_words(command: str) -> str:
    return " ".join(shlex.quote(word) for word in shlex.split(command))


def seed_flags(config: SlurmJobConfig) -> list[str]:
    """The seed flags as ``OffloadFlags.to_argv`` writes them, less the disk dir (known
    only on the node): ``$GREENROOM_ARGS``, and appended to the command line."""
    return config.train.offload_flags().to_argv(disk_dir=False)


def program(config: SlurmJobConfig) -> list[str]:
    """The trainer's command: ``command``, or ``greenroom train`` with its own arguments
    (``--save``/``--load`` of the checkpoint dir under ``--resume``)."""
    if config.command is not None:
        return list(config.command)
    t = config.train
    args = shlex.split(config.greenroom) + ["train"]
    if t.iterations is not None:
        args += ["--iterations", str(t.iterations)]
    args += ["--role", t.role]
    if t.checkpoint_dir:
        args += ["--save", t.checkpoint_dir, "--load", t.checkpoint_dir, "--resume", t.resume]
    return args + list(t.extra_args)


def resource_options(config: SlurmJobConfig) -> dict[str, str | bool]:
    """The job's resources as sbatch long options (``True``: a bare flag), in a fixed
    order. The one mapping from the config to Slurm: the script's ``#SBATCH`` lines and
    submitit's executor parameters are both made from it."""
    per_node = config.tasks_per_node if config.launcher == "srun" else 1
    options: dict[str, str | bool] = {
        "job-name": config.job_name,
        "nodes": str(config.nodes),
        "ntasks-per-node": str(per_node),
        "cpus-per-task": str(config.cpus_per_task),
    }
    if config.gpus_per_node:
        options["gpus-per-node"] = str(config.gpus_per_node)
    if config.mem is not None:
        options["mem"] = config.mem
    options["time"] = config.time
    for name in ("partition", "account", "qos"):
        if getattr(config, name) is not None:
            options[name] = getattr(config, name)
    if config.exclusive:
        options["exclusive"] = True
    for key in sorted(config.sbatch_extra):
        options[key] = config.sbatch_extra[key]
    return options


def sbatch_options(config: SlurmJobConfig) -> list[str]:
    """The ``#SBATCH`` options: the resources, then what only the batch script does
    (values were checked to be single words)."""
    options = dict(resource_options(config))
    extra = {key: options.pop(key) for key in config.sbatch_extra}
    # B: sends the signal to the batch shell only; it decides what the trainer gets.
    options["signal"] = f"B:{config.preempt_signal}@{config.preempt_signal_seconds}"
    if config.max_restarts:
        options["requeue"] = True
    else:
        # Slurm's default (JobRequeue=1) requeues a batch job that loses a node: 0 is never.
        options["no-requeue"] = True
    # Append: a requeued job keeps one batch log with every restart in it.
    options["open-mode"] = "append"
    # No --output into log_dir: Slurm opens it before the script runs, and a missing dir
    # fails the launch. The script makes log_dir and moves its own output there.
    options.update(extra)
    return [f"--{key}" if value is True else f"--{key}={value}" for key, value in options.items()]


def _container_parts(config: SlurmJobConfig) -> tuple[str, str]:
    """(srun flags, command prefix) that put a step inside the container; empty without one."""
    c = config.container
    if c is None:
        return "", ""
    extra = "".join("," + shlex.quote(m) for m in c.mounts)
    # Each part ends in a space so the template can put it straight before the command.
    if c.runtime == "pyxis":
        # One named container per job and node: pyxis imports the image once, and every
        # step of the job (reclaim, trainer, exit reclaim) reuses it.
        return (
            f'--container-image={shlex.quote(c.image)} --container-name=greenroom-"$SLURM_JOB_ID" '
            f'--container-mounts="$GREENROOM_SCRATCH:$GREENROOM_SCRATCH"{extra} '
        ), ""
    binds = "".join(f" --bind {shlex.quote(m)}" for m in c.mounts)
    nv = " --nv" if config.gpus_per_node else ""
    return "", f'apptainer exec{nv} --bind "$GREENROOM_SCRATCH"{binds} {shlex.quote(c.image)} '


def context(config: SlurmJobConfig, *, source: str) -> dict:
    srun_container, exec_container = _container_parts(config)
    return {
        "source": source,
        "sbatch_options": sbatch_options(config),
        "exports": [f"{name}={shlex.quote(value)}" for name, value in sorted(config.env.items())],
        "scratch": shlex.quote(config.scratch_dir) if config.scratch_dir else None,
        "log_dir": shlex.quote(config.log_dir),
        "master_port": str(config.master_port) if config.master_port else "$((20000 + SLURM_JOB_ID % 20000))",
        "setup": config.setup,
        "greenroom": _quote_words(config.greenroom),
        "torchrun": _quote_words(config.torchrun),
        "program": " ".join(shlex.quote(a) for a in program(config)),
        "seed_flags": " ".join(shlex.quote(a) for a in seed_flags(config)),
        "greenroom_args": shlex.quote(shlex.join(seed_flags(config))),
        "append_flags": config.appends_flags,
        "launcher": config.launcher,
        "tasks_per_node": config.tasks_per_node,
        "cpus_per_task": config.cpus_per_task,
        "preempt_signal": config.preempt_signal,
        "max_restarts": config.max_restarts,
        "pyxis": config.container is not None and config.container.runtime == "pyxis",
        "srun_container": srun_container,
        "exec_container": exec_container,
    }


def _environment(config: SlurmJobConfig) -> jinja2.Environment:
    loaders: list[jinja2.BaseLoader] = [jinja2.FileSystemLoader(TEMPLATE_DIR)]
    if os.sep in config.template or config.template not in shipped_templates():
        # A user's own template may still include the shipped _setup.sh.j2.
        loaders.insert(0, jinja2.FileSystemLoader(os.path.dirname(os.path.abspath(config.template))))
    return jinja2.Environment(
        loader=jinja2.ChoiceLoader(loaders),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _get_template(config: SlurmJobConfig, name: str) -> jinja2.Template:
    try:
        return _environment(config).get_template(name)
    except jinja2.TemplateNotFound:
        raise ConfigError(
            f"template: no template {config.template!r}; shipped templates: "
            f"{', '.join(shipped_templates())}, or give a path to your own .j2"
        ) from None
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"template {config.template}: line {e.lineno}: {e.message}") from None


def render(config: SlurmJobConfig, *, source: str = "CONFIG.yaml") -> str:
    """The sbatch script for ``config``; ``source`` names the config in its header."""
    name = config.template if config.template in shipped_templates() else os.path.basename(config.template)
    template = _get_template(config, name)
    try:
        return template.render(context(config, source=source))
    except jinja2.UndefinedError as e:
        raise ConfigError(f"template {config.template}: {e.message}") from None


def setup_lines(config: SlurmJobConfig) -> list[str]:
    """The script's environment and reclaim section, as lines for submitit's setup."""
    text = _get_template(config, SETUP_TEMPLATE).render(context(config, source="submitit"))
    return text.rstrip("\n").split("\n")
