"""The seed's flags, their rules, and the validated ``OffloadConfig`` built from them.

Any trainer adopts greenroom with two calls::

    greenroom.add_arguments(parser)
    config = greenroom.OffloadConfig.from_args(parser.parse_args())

or, with no parser of its own, ``config = greenroom.OffloadConfig.from_env()``. Both read
``$GREENROOM_ARGS``: the flags as ``to_argv()`` writes them, which the Helm chart and the
Slurm templates export to every trainer whatever its command (flags given on the command
line win over it).

Every rule violation is a ``ValueError`` whose message is one line naming the flag and
the fix; the CLI turns it into exit code 2 without a traceback.

Two layers, so that the flags are spelled out once:

``OffloadFlags``
    The flags and their pairing rules, and nothing else: no filesystem is looked at, so
    a job description made far from the nodes (a Slurm YAML, the Helm values) checks
    itself with it, and ``to_argv()`` is the one flag-to-argv mapping.
``OffloadConfig``
    The flags as a process on the node uses them: the disk dir resolved (``$SCRATCH``
    default, absolute) and refused when memory-backed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import warnings
from dataclasses import dataclass, field

from greenroom.dirs.roots import check_root, memory_problem
from greenroom.errors import ConfigError
from greenroom.io import fs
from greenroom.io.codec_names import CODECS, check_codec
from greenroom.units import GB, MAX_GB, MIB

TARGETS = ("cpu", "disk")
MOMENT_DTYPES = ("fp32", "bf16", "fp16", "fp8e4m3", "fp8e5m2")
# How StreamingAdam stores a bf16 param's fp32 master (greenroom.optim.remainder): its low
# 16 bits beside the param (the default, exact), or the whole fp32 value.
MASTER_LAYOUTS = ("remainder", "fp32")
# fp8 moments carry one fp32 scale per block of this many elements (see
# greenroom.optim.moments); plan's byte counts include it.
FP8_SCALE_BLOCK = 128
_MOMENT_BYTES = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8e4m3": 1.0 + 4 / FP8_SCALE_BLOCK,
    "fp8e5m2": 1.0 + 4 / FP8_SCALE_BLOCK,
}
DEFAULT_CHUNK_MB = 256


def moment_bytes_per_element(moment_dtype: str) -> float:
    return _MOMENT_BYTES[moment_dtype]


def check_one_of(name: str, value, choices: tuple[str, ...]) -> None:
    """The rule for a flag that takes one of ``choices`` (the target, the moment dtype, the
    master layout), in one line naming the flag or key ``name``."""
    if value not in choices:
        raise ConfigError(f"{name}: expected one of {', '.join(choices)}, got {value!r}")


def check_host_cache_gb(cache, *, name: str = "--stream-optimizer-state-host-cache-gb") -> None:
    """The rule for the host cache's GB, in one line naming the flag or key ``name``."""
    if isinstance(cache, bool) or not isinstance(cache, (int, float)) or not 0 <= cache <= MAX_GB:
        raise ConfigError(
            f"{name} must be a finite number of GB >= 0 and at most {MAX_GB:g} (an exabyte), got {cache!r}"
        )


def check_host_bytes(flag: str, value, nbytes: int, *, default=DEFAULT_CHUNK_MB, counted: str = "") -> None:
    """A host allocation of ``nbytes`` (for ``flag value``) must fit in this machine's
    RAM: checked at start-up instead of failing in the allocator, or later in the run.
    ``counted`` says what ``nbytes`` adds up, when more than the flag's own bytes."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if nbytes > ram:
        raise ConfigError(
            f"{flag} {value}: that needs {fs.human_bytes(nbytes)} of host memory per rank"
            f"{f' ({counted})' if counted else ''}, this machine has {fs.human_bytes(ram)}; "
            f"use a smaller value{_default(default)}"
        )


def check_disk_bytes(flag: str, value, nbytes: int, directory: str, *, counted: str = "") -> None:
    """Files of ``nbytes`` (for ``flag value``) must fit in the free space of
    ``directory``'s filesystem: checked before anything is written, where a
    preallocation would fail halfway through a run."""
    free = fs.free_bytes(directory)
    if nbytes > free:
        raise ConfigError(
            f"{flag} {value}: that needs {fs.human_bytes(nbytes)} on {directory}"
            f"{f' ({counted})' if counted else ''}, which has {fs.human_bytes(free)} free; "
            "use a smaller value or a dir on a larger disk"
        )


def _default(default) -> str:
    return "" if default is None else f" (default {default})"


def format_gb(value: float) -> str:
    """A GB amount as a flag value: whole numbers without a decimal point (``8``, as
    Helm and YAML write them), others in Python's shortest exact form (``0.5``)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


# The launcher's flags for any trainer (chart and Slurm templates), as one shell-quoted string.
ARGS_ENV = "GREENROOM_ARGS"
# The per-pod (chart) or per-node (Slurm) dir the launcher assigned for the per-rank dirs.
DISK_DIR_ENV = "GREENROOM_DISK_DIR"


def default_disk_dir() -> str | None:
    """``$GREENROOM_DISK_DIR`` (set by the chart and the templates), else
    ``$SCRATCH/greenroom_train_offload_<uid>``; None when neither is set."""
    assigned = os.environ.get(DISK_DIR_ENV)
    if assigned:
        return assigned
    scratch = os.environ.get("SCRATCH")
    if not scratch:
        return None
    return os.path.join(scratch, f"greenroom_train_offload_{os.getuid()}")


@dataclass(kw_only=True, slots=True)
class OffloadFlags:
    """The seed's flags, checked against their pairing rules; no filesystem access."""

    offload_train: bool = False
    """Move the actor's device memory out while it sleeps (``--offload-train``)."""

    offload_train_target: str | None = None
    """``cpu`` (pinned host copy, default) or ``disk`` (per-rank files). None means not
    given, which resolves to ``cpu``; an explicit value is checked against the rules."""

    offload_train_disk_dir: str | None = None
    """Root of the per-rank dirs; defaults to ``$SCRATCH/greenroom_train_offload_<uid>``."""

    offload_train_disk_chunk_mb: int = DEFAULT_CHUNK_MB
    """Size of each mechanism's pinned host staging buffer, in MiB."""

    offload_train_disk_compression: str = "auto"
    """Lossless codec of what both mechanisms write to disk (``greenroom.io.compression``):
    ``auto`` (``nvcomp-ans`` where CUDA is up and nvCOMP loads, else none), ``none``,
    ``nvcomp-ans`` or ``zstd``."""

    stream_optimizer_state_to_disk: bool = False
    """Keep fp32 master params and Adam moments in per-bucket files."""

    stream_optimizer_state_moment_dtype: str = "fp32"
    """Storage dtype of the streamed Adam moments."""

    stream_optimizer_state_master_layout: str = "remainder"
    """How ``StreamingAdam`` stores a bf16 param's fp32 master: ``remainder`` (its low 16
    bits beside the param, rebuilt exactly; ``greenroom.optim.remainder``) or ``fp32``
    (whole, 2 B/param more). Other params are unaffected."""

    stream_optimizer_state_host_cache_gb: float = 0.0
    """GB (1e9 bytes) of host memory per rank that keeps whole buckets of the streamed
    state instead of the disk (pinned when CUDA is up); 0: every bucket streams."""

    no_load_optim: bool = False
    """On resume, accept a fresh optimizer state instead of requiring the streamed one."""

    allow_tmpfs: bool = False
    """Accept a memory-backed disk dir (tests only: it defeats the purpose)."""

    _target_given: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._target_given = self.offload_train_target is not None
        target = self.offload_train_target or "cpu"
        check_one_of("--offload-train-target", target, TARGETS)
        self.offload_train_target = target
        chunk = self.offload_train_disk_chunk_mb
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
            raise ConfigError(f"--offload-train-disk-chunk-mb must be a positive integer number of MiB, got {chunk!r}")
        compression = self.offload_train_disk_compression
        check_codec(compression, chunk)
        check_one_of("--stream-optimizer-state-moment-dtype", self.stream_optimizer_state_moment_dtype, MOMENT_DTYPES)
        layout = self.stream_optimizer_state_master_layout
        check_one_of("--stream-optimizer-state-master-layout", layout, MASTER_LAYOUTS)
        if layout != "remainder" and not self.stream_optimizer_state_to_disk:
            raise ConfigError(
                f"--stream-optimizer-state-master-layout {layout} lays out streamed masters and needs "
                "--stream-optimizer-state-to-disk: add it (or drop the master layout)"
            )
        cache = self.stream_optimizer_state_host_cache_gb
        check_host_cache_gb(cache)
        self.stream_optimizer_state_host_cache_gb = cache = float(cache)
        if cache and not self.stream_optimizer_state_to_disk:
            raise ConfigError(
                "--stream-optimizer-state-host-cache-gb caches streamed buckets and needs "
                "--stream-optimizer-state-to-disk: add it (or drop the host cache)"
            )
        if target == "disk" and not self.offload_train:
            raise ConfigError(
                "--offload-train-target disk requires --offload-train: add --offload-train "
                "(or drop --offload-train-target disk)"
            )
        if self.offload_train and self.stream_optimizer_state_to_disk and target != "disk":
            raise ConfigError(
                "--stream-optimizer-state-to-disk under --offload-train requires --offload-train-target disk: "
                "a run that cannot hold its optimizer state on the GPU will not hold a pinned host copy "
                "of the whole actor either"
            )
        if self.stream_optimizer_state_to_disk and not self.offload_train and self._target_given:
            warnings.warn(
                "--offload-train-target is ignored without --offload-train (streaming alone is the disaggregated case)",
                stacklevel=3,
            )

    def to_argv(self, *, disk_dir: bool = True) -> list[str]:
        """The flags as ``greenroom train`` (or any ``add_arguments`` parser) takes them,
        every value said explicitly so a job script or pod spec shows what runs; parsing
        the result gives these flags back. ``disk_dir=False`` leaves out
        ``--offload-train-disk-dir`` for launchers that only know it on the node."""
        argv: list[str] = []
        if self.offload_train:
            argv += ["--offload-train", "--offload-train-target", self.offload_train_target]
        if disk_dir and self.offload_train_disk_dir is not None:
            argv += ["--offload-train-disk-dir", self.offload_train_disk_dir]
        argv += [
            "--offload-train-disk-chunk-mb",
            str(self.offload_train_disk_chunk_mb),
            "--offload-train-disk-compression",
            self.offload_train_disk_compression,
        ]
        if self.stream_optimizer_state_to_disk:
            argv += [
                "--stream-optimizer-state-to-disk",
                "--stream-optimizer-state-moment-dtype",
                self.stream_optimizer_state_moment_dtype,
            ]
            if self.stream_optimizer_state_master_layout != "remainder":
                argv += ["--stream-optimizer-state-master-layout", self.stream_optimizer_state_master_layout]
            if self.stream_optimizer_state_host_cache_gb:
                argv += ["--stream-optimizer-state-host-cache-gb", format_gb(self.stream_optimizer_state_host_cache_gb)]
        for name in ("no_load_optim", "allow_tmpfs"):
            if getattr(self, name):
                argv.append("--" + name.replace("_", "-"))
        return argv

    @property
    def offload_to_disk(self) -> bool:
        return self.offload_train and self.offload_train_target == "disk"

    @property
    def uses_disk(self) -> bool:
        """Whether any mechanism writes to ``offload_train_disk_dir``."""
        return self.offload_to_disk or self.stream_optimizer_state_to_disk

    @property
    def chunk_bytes(self) -> int:
        return self.offload_train_disk_chunk_mb * MIB

    @property
    def staging_bytes_per_rank(self) -> int:
        """Pinned host staging per rank: each disk mechanism allocates its own chunk, so
        disk offload plus streaming costs 2x the chunk."""
        return self.chunk_bytes * (int(self.offload_to_disk) + int(self.stream_optimizer_state_to_disk))

    @property
    def host_cache_bytes(self) -> int:
        """The streaming's host-cache budget per rank, in bytes (what it may take: it
        holds whole buckets only, so it may take less)."""
        return int(self.stream_optimizer_state_host_cache_gb * GB) if self.stream_optimizer_state_to_disk else 0

    @property
    def host_bytes_per_rank(self) -> int:
        """Host memory greenroom's mechanisms take per rank at most: the staging and the
        streaming's host cache."""
        return self.staging_bytes_per_rank + self.host_cache_bytes

    @classmethod
    def from_args(cls, ns: argparse.Namespace):
        return cls(**{name: getattr(ns, name) for name in FLAG_FIELDS})

    @classmethod
    def from_env(cls, environ=None):
        """The flags in ``$GREENROOM_ARGS`` (defaults where it is unset or empty); a word
        that is not one of the seed's flags is a one-line error naming the variable."""
        return cls.from_args(_flags_parser().parse_args(env_argv(environ)))


class _Omitting:
    """An argument group that leaves out the flags of ``omit`` (their field names)."""

    def __init__(self, group, omit: tuple[str, ...]) -> None:
        self.group, self.omit = group, omit

    def add_argument(self, *names, **kwargs):
        if names[0].lstrip("-").replace("-", "_") not in self.omit:
            self.group.add_argument(*names, **kwargs)


# The dataclass fields that are flags, in flag order (``--`` + the name with dashes).
FLAG_FIELDS = (
    "offload_train",
    "offload_train_target",
    "offload_train_disk_dir",
    "offload_train_disk_chunk_mb",
    "offload_train_disk_compression",
    "stream_optimizer_state_to_disk",
    "stream_optimizer_state_moment_dtype",
    "stream_optimizer_state_master_layout",
    "stream_optimizer_state_host_cache_gb",
    "no_load_optim",
    "allow_tmpfs",
)


@dataclass(kw_only=True, slots=True)
class OffloadConfig(OffloadFlags):
    """The flags as a rank uses them: the rules, then the disk dir resolved and checked."""

    def __post_init__(self) -> None:
        # Explicit base call: zero-argument super() breaks in a slots dataclass.
        OffloadFlags.__post_init__(self)
        if self.uses_disk:
            self._resolve_disk_dir()

    def _resolve_disk_dir(self) -> None:
        if self.offload_train_disk_dir is None:
            self.offload_train_disk_dir = default_disk_dir()
        if not self.offload_train_disk_dir:
            raise ConfigError("no disk dir: pass --offload-train-disk-dir DIR on node-local NVMe, or set $SCRATCH")
        self.offload_train_disk_dir = os.path.abspath(self.offload_train_disk_dir)
        # Before any work: a root this user cannot make a rank dir in (greenroom.dirs.roots).
        check_root(self.offload_train_disk_dir, name="--offload-train-disk-dir")
        check_host_bytes("--offload-train-disk-chunk-mb", self.offload_train_disk_chunk_mb, self.staging_bytes_per_rank)
        if self.host_cache_bytes:
            check_host_bytes(
                "--stream-optimizer-state-host-cache-gb",
                format_gb(self.stream_optimizer_state_host_cache_gb),
                self.host_bytes_per_rank,
                default=0,
                counted="the host cache plus the pinned staging",
            )
        problem = memory_problem(self.offload_train_disk_dir)
        if problem is not None:
            message = f"--offload-train-disk-dir {self.offload_train_disk_dir} {problem}"
            if not self.allow_tmpfs:
                raise ConfigError(message + " (or pass --allow-tmpfs for a test)")
            warnings.warn(message + "; continuing because of --allow-tmpfs", stacklevel=3)


def env_argv(environ=None) -> list[str]:
    """``$GREENROOM_ARGS`` split as a shell would, checked to hold only the seed's flags."""
    text = (os.environ if environ is None else environ).get(ARGS_ENV, "")
    try:
        argv = shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"${ARGS_ENV}: cannot split {text!r} ({e}); write the flags as to_argv() does") from None
    try:
        _, unknown = _flags_parser().parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ConfigError(f"${ARGS_ENV}: {e}") from None
    if unknown:
        raise ConfigError(
            f"${ARGS_ENV}: {' '.join(unknown)} is not a greenroom offload/streaming flag; "
            "it holds only those (pass the trainer's own arguments on its command line)"
        )
    return argv


def _flags_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"${ARGS_ENV}", add_help=False, exit_on_error=False)
    _add_flags(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser, *, omit: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """Add the seed's flags (and ``--allow-tmpfs``) to any argparse parser; their
    defaults come from ``$GREENROOM_ARGS`` where it is set (the command line wins).
    ``omit``: fields whose flags mean nothing to the command (``plan`` resumes nothing:
    ``no_load_optim``); they keep their defaults."""
    _add_flags(parser, omit)
    parser.set_defaults(**{name: OffloadFlags.__dataclass_fields__[name].default for name in omit})
    argv = env_argv()
    if argv:
        given = _flags_parser().parse_args(argv)
        parser.set_defaults(**{name: getattr(given, name) for name in FLAG_FIELDS})
    return parser


def _add_flags(parser: argparse.ArgumentParser, omit: tuple[str, ...] = ()) -> None:
    group = _Omitting(parser.add_argument_group("greenroom offload and streaming"), omit)
    group.add_argument(
        "--offload-train",
        action="store_true",
        help="the actor sleeps (its device memory leaves the GPU) between training phases",
    )
    # default None: an explicit value must be told apart from the default (see the rules).
    group.add_argument(
        "--offload-train-target",
        choices=TARGETS,
        default=None,
        help="where the sleeping actor goes: a pinned host copy (cpu, the default) or per-rank files (disk)",
    )
    group.add_argument(
        "--offload-train-disk-dir",
        default=None,
        metavar="DIR",
        help="root of the per-rank dirs, on node-local NVMe "
        "(default $GREENROOM_DISK_DIR, else $SCRATCH/greenroom_train_offload_<uid>)",
    )
    group.add_argument(
        "--offload-train-disk-chunk-mb",
        type=int,
        default=DEFAULT_CHUNK_MB,
        metavar="MB",
        help="pinned host staging buffer per mechanism and rank, MiB",
    )
    group.add_argument(
        "--offload-train-disk-compression",
        choices=CODECS,
        default="auto",
        help="lossless codec of what both mechanisms write to disk: auto runs nvcomp-ans on the GPU "
        "where the nvCOMP wheel loads (the nvcomp extra), else none; zstd (host) is opt-in "
        "(docs/compression.md)",
    )
    group.add_argument(
        "--stream-optimizer-state-to-disk",
        action="store_true",
        help="fp32 master params and Adam moments live in per-bucket files; the step updates one "
        "bucket at a time on the GPU (three in flight: one read ahead, one writing back)",
    )
    group.add_argument(
        "--stream-optimizer-state-moment-dtype",
        choices=MOMENT_DTYPES,
        default="fp32",
        help="storage dtype of the streamed Adam moments (fp32 is bit-identical to resident AdamW)",
    )
    group.add_argument(
        "--stream-optimizer-state-master-layout",
        choices=MASTER_LAYOUTS,
        default="remainder",
        help="how `StreamingAdam` stores a bf16 param's fp32 master: its low 16 bits beside the "
        "param, rebuilt exactly (10 B/param with fp32 moments), or whole (`fp32`, 12 B/param); "
        "Megatron's mains are stored whole either way",
    )
    group.add_argument(
        "--stream-optimizer-state-host-cache-gb",
        type=float,
        default=0.0,
        metavar="GB",
        help="host memory per rank (GB, pinned with CUDA) that keeps whole buckets of the "
        "streamed state off the disk; the rest streams (0: all of it)",
    )
    group.add_argument(
        "--no-load-optim",
        action="store_true",
        help="on resume, start a fresh optimizer state instead of requiring the saved one",
    )
    group.add_argument(
        "--allow-tmpfs",
        action="store_true",
        help="accept a tmpfs/ramfs disk dir (tests only: it keeps the data in RAM)",
    )
