"""The Slurm job a user describes in YAML, validated before anything is rendered.

``load_config(path)`` reads the YAML into ``SlurmJobConfig`` (with ``TrainArgs`` and an
optional ``ContainerConfig`` nested in it). Every mistake is a ``ValueError`` whose one
line names the file, the key, the bad value and the fix, so ``greenroom slurm`` exits 2
before ``sbatch`` ever sees the script.

The shape of each single value is ``greenroom.slurm.values``'s to check; reading the YAML
with the text a user wrote kept as text is ``greenroom.slurm.yamlread``'s.
"""

from __future__ import annotations

import dataclasses
import difflib
import shlex
import signal
import warnings
from dataclasses import dataclass, field

import yaml

from greenroom.config import (
    MASTER_LAYOUTS,
    MOMENT_DTYPES,
    TARGETS,
    OffloadFlags,
    check_host_cache_gb,
    check_one_of,
)
from greenroom.dirs.names import is_dir_name
from greenroom.errors import ConfigError
from greenroom.io.codec_names import check_codec_name
from greenroom.slurm.values import (
    ENV_NAME,
    MEMORY,
    check_scratch_dir,
    non_negative_int,
    positive_int,
    sbatch_word,
    time_minutes,
    unit,
)
from greenroom.slurm.yamlread import read_yaml

LAUNCHERS = ("srun", "torchrun")
CONTAINER_RUNTIMES = ("pyxis", "apptainer")
DEFAULT_TEMPLATE = "sbatch.sh.j2"
MAX_SIGNAL_SECONDS = 65535  # sbatch --signal's upper bound

# Seed-flag defaults are OffloadFlags' own (one source: a test compares them).
_FLAG_DEFAULTS = OffloadFlags()
GREENROOM_ARGS_MODES = ("auto", "append", "env")
RESUME_MODES = ("auto", "strict")
# sbatch options the config has a key for, or the script sets itself: an sbatch_extra
# entry would silently replace them (a --signal of its own breaks the preemption path).
_OWNED_OPTIONS = {
    **{
        option: f"set by the config key {key}"
        for option, key in (
            ("job-name", "job_name"),
            ("nodes", "nodes"),
            ("ntasks-per-node", "tasks_per_node"),
            ("cpus-per-task", "cpus_per_task"),
            ("gpus-per-node", "gpus_per_node"),
            ("mem", "mem"),
            ("time", "time"),
            ("partition", "partition"),
            ("account", "account"),
            ("qos", "qos"),
            ("exclusive", "exclusive"),
            ("signal", "preempt_signal and preempt_signal_seconds"),
            ("requeue", "max_restarts"),
            ("no-requeue", "max_restarts"),
        )
    },
    "open-mode": "set by the script (append: a requeued job keeps one log)",
}


@dataclass(kw_only=True, slots=True)
class TrainArgs:
    """The seed's flags (every trainer gets them in ``$GREENROOM_ARGS``; ``greenroom
    train`` also on its command line), plus ``greenroom train``'s own. The defaults are
    ``OffloadFlags``'. ``--offload-train-disk-dir`` is not here: the job derives it from
    the node-local scratch dir at run time."""

    offload_train: bool = _FLAG_DEFAULTS.offload_train
    """``--offload-train``."""

    offload_train_target: str | None = None
    """``--offload-train-target`` (cpu or disk; null: not given, which means cpu)."""

    offload_train_disk_chunk_mb: int = field(default=_FLAG_DEFAULTS.offload_train_disk_chunk_mb, metadata=unit("MiB"))
    """``--offload-train-disk-chunk-mb``: pinned staging buffer per mechanism and rank."""

    offload_train_disk_compression: str = _FLAG_DEFAULTS.offload_train_disk_compression
    """``--offload-train-disk-compression``: auto, none, nvcomp-ans or zstd."""

    stream_optimizer_state_to_disk: bool = _FLAG_DEFAULTS.stream_optimizer_state_to_disk
    """``--stream-optimizer-state-to-disk``."""

    stream_optimizer_state_moment_dtype: str = _FLAG_DEFAULTS.stream_optimizer_state_moment_dtype
    """``--stream-optimizer-state-moment-dtype``."""

    stream_optimizer_state_master_layout: str = _FLAG_DEFAULTS.stream_optimizer_state_master_layout
    """``--stream-optimizer-state-master-layout``: remainder (the default, left out) or fp32."""

    stream_optimizer_state_host_cache_gb: float = field(
        default=_FLAG_DEFAULTS.stream_optimizer_state_host_cache_gb, metadata=unit("GB (10^9 bytes) per rank")
    )
    """``--stream-optimizer-state-host-cache-gb``: host memory per rank (GB) for whole
    buckets kept off the disk; 0 (the default) leaves the flag out."""

    no_load_optim: bool = _FLAG_DEFAULTS.no_load_optim
    """``--no-load-optim``: on resume accept a fresh optimizer state."""

    iterations: int | None = field(default=None, metadata=unit("iterations"))
    """``--iterations`` (null: the trainer's default)."""

    role: str = "actor"
    """``--role``: names the per-rank dirs, so two models of one job never share files."""

    checkpoint_dir: str | None = None
    """``--save`` and ``--load`` dir on shared storage (``greenroom train`` only): the
    checkpoint root, ``iter_NNNNNNN/`` dirs and ``latest_checkpointed_iteration.txt``."""

    resume: str = "auto"
    """``--resume`` with ``checkpoint_dir``: ``auto`` starts fresh while the dir does not
    exist yet, so the first run and every requeue run one command, each requeue loading
    the newest iteration that verifies; ``strict`` requires it."""

    extra_args: list[str] = field(default_factory=list)
    """Further ``greenroom train`` arguments, passed through verbatim (each quoted)."""

    def offload_flags(self) -> OffloadFlags:
        """The seed's flags of this job (the disk dir is only known on the node)."""
        with warnings.catch_warnings():
            # "target ignored without --offload-train": the rendered flags leave it out then.
            warnings.simplefilter("ignore")
            return OffloadFlags(
                offload_train=self.offload_train,
                offload_train_target=self.offload_train_target,
                offload_train_disk_chunk_mb=self.offload_train_disk_chunk_mb,
                offload_train_disk_compression=self.offload_train_disk_compression,
                stream_optimizer_state_to_disk=self.stream_optimizer_state_to_disk,
                stream_optimizer_state_moment_dtype=self.stream_optimizer_state_moment_dtype,
                stream_optimizer_state_master_layout=self.stream_optimizer_state_master_layout,
                stream_optimizer_state_host_cache_gb=self.stream_optimizer_state_host_cache_gb,
                no_load_optim=self.no_load_optim,
            )


@dataclass(kw_only=True, slots=True)
class ContainerConfig:
    """Run every step inside a container image."""

    runtime: str
    """``pyxis`` (``srun --container-image``, enroot) or ``apptainer`` (``apptainer exec``)."""

    image: str
    """The image: a pyxis/enroot image reference or squashfs, or an apptainer .sif."""

    mounts: list[str] = field(default_factory=list)
    """Extra ``SRC:DST[:FLAGS]`` mounts; the scratch dir is always mounted at its own path."""


@dataclass(kw_only=True, slots=True)
class SlurmJobConfig:
    """One Slurm job running ``greenroom train`` or your own trainer (``command``); see
    deploy/slurm/examples/."""

    job_name: str = "greenroom"
    """``--job-name``; also names the log files."""

    nodes: int = field(default=1, metadata=unit("nodes"))
    """``--nodes``."""

    gpus_per_node: int = field(default=0, metadata=unit("GPUs per node"))
    """``--gpus-per-node`` (0: a CPU job, no GPU request)."""

    tasks_per_node: int | None = field(default=None, metadata=unit("processes per node"))
    """Trainer processes per node (default: ``gpus_per_node``, or 1 on a CPU job). With the
    srun launcher they are Slurm tasks; with torchrun, torchrun's ``--nproc-per-node``."""

    cpus_per_task: int | None = field(default=None, metadata=unit("CPUs per Slurm task"))
    """``--cpus-per-task`` as Slurm means it: the CPUs of one Slurm task. With the srun
    launcher a task is one trainer process; with torchrun it is the node's one torchrun,
    which shares them among its ``tasks_per_node`` processes, so it needs at least one
    each. null: 1 with srun, ``tasks_per_node`` with torchrun."""

    mem: str | None = field(default=None, metadata=unit("MiB per node, or with a K, M, G or T suffix"))
    """``--mem`` per node, e.g. ``64G`` (null: the partition's default; ``0``: all)."""

    time: str = field(default="01:00:00", metadata=unit("minutes, or [D-]HH:MM:SS"))
    """``--time`` in any Slurm form (``MM``, ``HH:MM:SS``, ``D-HH:MM:SS`` ...), as written:
    an unquoted ``4:00:00`` stays that, not YAML 1.1's base-60 int."""

    partition: str | None = None
    """``--partition``."""

    account: str | None = None
    """``--account``."""

    qos: str | None = None
    """``--qos``."""

    exclusive: bool = False
    """``--exclusive``: no other job on the nodes (and their NVMe)."""

    launcher: str = "srun"
    """``srun``: one task per process, RANK/LOCAL_RANK/WORLD_SIZE from
    SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS; ``torchrun``: one torchrun per node, rendezvous at the
    job's first node."""

    master_port: int | None = field(default=None, metadata=unit("TCP port"))
    """Rendezvous port (default: 20000 + job id % 20000, so jobs sharing a node differ)."""

    preempt_signal: str = "USR1"
    """Signal Slurm sends the batch script before the time limit or a preemption
    (``--signal=B:<sig>@<seconds>``); the script then stops the trainer and requeues."""

    preempt_signal_seconds: int = field(default=120, metadata=unit("seconds"))
    """How long before the end the signal comes."""

    max_restarts: int = field(default=3, metadata=unit("requeues"))
    """Requeues after the preemption signal, counted by SLURM_RESTART_COUNT. Above 0 the
    job is also ``--requeue``: Slurm requeues it when it loses a node (a node failure's
    requeue counts too, and Slurm's MaxBatchRequeue caps those). 0: never, ``--no-requeue``."""

    scratch_dir: str | None = None
    """Node-local scratch root (NVMe; a job_container/tmpfs per-job /tmp is on disk and
    fine, /dev/shm is not). null: ``$SCRATCH`` on the node at run time. The per-rank
    dirs live in ``<scratch>/greenroom_train_offload_<uid>/<job>/<role>/rank<NNNNN>``."""

    log_dir: str = "logs"
    """Where ``<job_name>-<jobid>.out`` (the batch script) and one file per task and
    restart go; the script creates it (Slurm's own ``slurm-<jobid>.out``, in the dir the
    job was submitted from, keeps only what happens before the script starts)."""

    greenroom: str = "greenroom"
    """The command that runs greenroom on the nodes, e.g. ``/opt/venv/bin/greenroom``
    or ``python3 -m greenroom.cli.main`` (split like a shell would, each word quoted)."""

    torchrun: str = "torchrun"
    """The torchrun command (launcher ``torchrun`` only)."""

    command: str | list[str] | None = None
    """Your trainer's command (a list of words, or one string split like a shell would),
    run by each task or, with the torchrun launcher, by torchrun (``--no-python``: start
    it with its interpreter). null: ``greenroom train`` with ``train``'s flags."""

    greenroom_args: str = "auto"
    """How ``train``'s seed flags reach the trainer. Always: ``$GREENROOM_ARGS`` (read by
    ``OffloadConfig.from_env()`` and ``add_arguments``); ``append`` also appends them to
    the command line, ``env`` does not; ``auto``: append for ``greenroom train``, env for
    your ``command``."""

    env: dict[str, str] = field(default_factory=dict)
    """Environment exported to every step (values quoted), each value as written: an
    unquoted ``0022`` or ``2.10`` stays that (true, false and null must be quoted)."""

    setup: list[str] = field(default_factory=list)
    """Shell lines run before the steps (``module load ...``), verbatim."""

    sbatch_extra: dict[str, str | bool] = field(default_factory=dict)
    """Further ``#SBATCH`` options: ``{constraint: nvme}`` gives ``--constraint=nvme`` (the
    value as written: ``begin: 10:30`` stays 10:30), ``true`` gives a bare flag; false and
    null are refused (they have no ``#SBATCH`` form)."""

    template: str = DEFAULT_TEMPLATE
    """The template: a name from the shipped templates or a path to your own .j2."""

    container: ContainerConfig | None = None
    """Run the steps in a container (pyxis or apptainer)."""

    train: TrainArgs = field(default_factory=TrainArgs)
    """The trainer's flags."""

    def __post_init__(self) -> None:
        positive_int("nodes", self.nodes)
        non_negative_int("gpus_per_node", self.gpus_per_node)
        non_negative_int("max_restarts", self.max_restarts)
        if self.tasks_per_node is None:
            self.tasks_per_node = self.gpus_per_node or 1
        positive_int("tasks_per_node", self.tasks_per_node)
        if self.gpus_per_node and self.tasks_per_node > self.gpus_per_node:
            raise ConfigError(
                f"tasks_per_node: {self.tasks_per_node} processes cannot each have a GPU of "
                f"gpus_per_node {self.gpus_per_node}; use at most one process per GPU"
            )
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"launcher: expected one of {', '.join(LAUNCHERS)}, got {self.launcher!r}")
        if self.cpus_per_task is None:
            self.cpus_per_task = self.tasks_per_node if self.launcher == "torchrun" else 1
        positive_int("cpus_per_task", self.cpus_per_task)
        if self.launcher == "torchrun" and self.cpus_per_task < self.tasks_per_node:
            raise ConfigError(
                f"cpus_per_task: {self.cpus_per_task} CPUs cannot give each of torchrun's "
                f"{self.tasks_per_node} processes one; with launcher torchrun it counts the CPUs of "
                f"the node's one task (all its processes): use at least {self.tasks_per_node}"
            )
        if self.master_port is not None:
            positive_int("master_port", self.master_port)
            if not 1024 <= self.master_port <= 65535:
                raise ConfigError(f"master_port must be in 1024..65535, got {self.master_port}")
        for name in ("job_name", "partition", "account", "qos"):
            value = getattr(self, name)
            if value is not None:
                sbatch_word(name, value)
        if self.mem is not None:
            self.mem = str(self.mem)
            if not MEMORY.match(self.mem):
                raise ConfigError(f"mem: expected a size like 64G or 65536 (MiB), got {self.mem!r}")
        time_minutes(self.time)
        try:
            signal.Signals[f"SIG{self.preempt_signal}"]
        except (KeyError, TypeError):
            raise ConfigError(
                f"preempt_signal: expected a signal name like USR1 (without SIG), got {self.preempt_signal!r}"
            ) from None
        positive_int("preempt_signal_seconds", self.preempt_signal_seconds)
        if self.preempt_signal_seconds > MAX_SIGNAL_SECONDS:
            raise ConfigError(
                f"preempt_signal_seconds must be at most {MAX_SIGNAL_SECONDS}, got {self.preempt_signal_seconds}"
            )
        for name, value in self.env.items():
            if not isinstance(name, str) or not ENV_NAME.match(name):
                raise ConfigError(f"env: {name!r} is not a valid environment variable name")
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ConfigError(f"env.{name}: expected a string, got {value!r}; put the value in quotes")
            self.env[name] = str(value)
        for key, value in self.sbatch_extra.items():
            sbatch_word("sbatch_extra key", str(key))
            # Neither has an #SBATCH form: str() would render --requeue=False or --nice=None.
            if value is False:
                fix = (
                    "leave the key out and set max_restarts: 0, which renders --no-requeue"
                    if key == "requeue"
                    else f"to not pass --{key}, leave the key out"
                )
                raise ConfigError(
                    f"sbatch_extra.{key}: false is no sbatch value (it would render --{key}=False); {fix}"
                )
            if value is None:
                raise ConfigError(
                    f"sbatch_extra.{key}: null is no sbatch value (it would render --{key}=None); "
                    f"write {key}: VALUE, {key}: true for a bare --{key}, or leave the key out"
                )
            if str(key) in _OWNED_OPTIONS:
                raise ConfigError(
                    f"sbatch_extra.{key}: --{key} is {_OWNED_OPTIONS[str(key)]}; an sbatch_extra "
                    "entry would replace it behind the config's back: leave it out"
                )
            if value is not True:
                sbatch_word(f"sbatch_extra.{key}", str(value))
        if self.command is not None:
            words = self.command if isinstance(self.command, list) else None
            if isinstance(self.command, str) and self.command.strip():
                try:
                    words = shlex.split(self.command)
                except ValueError as e:
                    raise ConfigError(f"command: cannot split {self.command!r} ({e})") from None
            if not words or not all(isinstance(w, str) and w for w in words):
                raise ConfigError(f"command: expected a non-empty list of words (or one string), got {self.command!r}")
            self.command = words
        if self.greenroom_args not in GREENROOM_ARGS_MODES:
            raise ConfigError(
                f"greenroom_args: expected one of {', '.join(GREENROOM_ARGS_MODES)}, got {self.greenroom_args!r}"
            )
        for name in ("greenroom", "torchrun", "template"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"{name}: expected a non-empty string, got {value!r}")
        sbatch_word("log_dir", self.log_dir)
        if not all(isinstance(line, str) for line in self.setup):
            raise ConfigError(f"setup: expected a list of shell lines, got {self.setup!r}")
        if self.scratch_dir is not None:
            check_scratch_dir(self.scratch_dir)
        _check_train(self.train)
        if self.command is not None:
            t = self.train
            for name, unset in (("iterations", None), ("checkpoint_dir", None), ("extra_args", [])):
                if getattr(t, name) != unset:
                    raise ConfigError(
                        f"train.{name} is a greenroom train argument, and command runs your own "
                        "trainer: put it in command (train holds only the seed flags then)"
                    )
        if self.container is not None:
            if self.container.runtime not in CONTAINER_RUNTIMES:
                raise ConfigError(
                    f"container.runtime: expected one of {', '.join(CONTAINER_RUNTIMES)}, "
                    f"got {self.container.runtime!r}"
                )
            if not isinstance(self.container.image, str) or not self.container.image:
                raise ConfigError("container.image: expected an image reference or path")
            for mount in self.container.mounts:
                if not isinstance(mount, str) or ":" not in mount or "," in mount:
                    raise ConfigError(f"container.mounts: expected SRC:DST[:FLAGS] (no commas), got {mount!r}")

    @property
    def appends_flags(self) -> bool:
        """Whether the seed flags go on the trainer's command line too."""
        return self.greenroom_args == "append" or (self.greenroom_args == "auto" and self.command is None)

    @property
    def processes(self) -> int:
        """World size: trainer processes in the whole job."""
        return self.nodes * self.tasks_per_node


def _check_train(train: TrainArgs) -> None:
    # OffloadFlags' own rules, each naming the train.* key.
    if train.offload_train_target is not None:
        check_one_of("train.offload_train_target", train.offload_train_target, TARGETS)
    check_one_of("train.stream_optimizer_state_moment_dtype", train.stream_optimizer_state_moment_dtype, MOMENT_DTYPES)
    check_one_of(
        "train.stream_optimizer_state_master_layout", train.stream_optimizer_state_master_layout, MASTER_LAYOUTS
    )
    positive_int("train.offload_train_disk_chunk_mb", train.offload_train_disk_chunk_mb)
    check_codec_name(train.offload_train_disk_compression, name="train.offload_train_disk_compression")
    check_host_cache_gb(train.stream_optimizer_state_host_cache_gb, name="train.stream_optimizer_state_host_cache_gb")
    if train.iterations is not None:
        positive_int("train.iterations", train.iterations)
    if train.resume not in RESUME_MODES:
        raise ConfigError(f"train.resume: expected one of {', '.join(RESUME_MODES)}, got {train.resume!r}")
    # The trainer's own rule (greenroom.dirs.names), so a bad role fails here, not after queueing.
    if not is_dir_name(train.role):
        raise ConfigError(
            f"train.role: {train.role!r} is not a valid directory name; "
            "give a name without '/' that is not . or .. (e.g. actor)"
        )
    if not isinstance(train.extra_args, list) or not all(isinstance(a, str) for a in train.extra_args):
        raise ConfigError(f"train.extra_args: expected a list of strings, got {train.extra_args!r}")
    # The trainer's own pairing rules, checked here so a bad pair fails before submission.
    try:
        train.offload_flags()
    except ValueError as e:
        raise ConfigError(f"train: {e}") from None


def _build(cls, data, where: str):
    """``cls(**data)`` with unknown keys and wrong shapes reported by their YAML path."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'the config'}: expected a mapping of keys, got {type(data).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            guess = f": did you mean '{where}{close[0]}'?" if close else ";"
            raise ConfigError(f"unknown key '{where}{key}'{guess} known keys: {', '.join(sorted(known))}")
    kwargs = dict(data)
    if cls is SlurmJobConfig:
        if "train" in kwargs:
            kwargs["train"] = _build(TrainArgs, kwargs["train"] or {}, "train.")
        if kwargs.get("container") is not None:
            kwargs["container"] = _build(ContainerConfig, kwargs["container"], "container.")
    for name, kind in (("env", dict), ("sbatch_extra", dict), ("setup", list), ("mounts", list)):
        if name in kwargs and name in known and not isinstance(kwargs[name], kind):
            raise ConfigError(
                f"{where}{name}: expected a {'mapping' if kind is dict else 'list'}, got {kwargs[name]!r}"
            )
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required key is missing
        raise ConfigError(f"{where or 'the config'}: {e}") from None


def config_from_dict(data: dict) -> SlurmJobConfig:
    return _build(SlurmJobConfig, data, "")


def load_config(path: str) -> SlurmJobConfig:
    """Read and validate a job YAML; errors name the file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = read_yaml(f, SlurmJobConfig)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text (a binary file?); give a job YAML") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    if data is None:
        raise ConfigError(f"{path}: the file is empty; see deploy/slurm/examples for a job YAML")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings at the top, got {type(data).__name__}")
    try:
        return config_from_dict(data)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
