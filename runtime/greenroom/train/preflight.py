"""Start-up checks of ``greenroom train``'s paths and sizes: a run never trains for
hours and then dies on a path it could have checked in a second, and a typo in a size
never allocates until the OOM killer comes.

Each check answers with a one-line ``ValueError`` naming the flag, the path and what to
do, and leaves nothing behind on disk (the write probe removes its file).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile

from greenroom.devices import check_device_bytes
from greenroom.dirs.names import is_dir_name
from greenroom.errors import ConfigError
from greenroom.io import fs, publish
from greenroom.log import get_logger
from greenroom.train import rotation

log = get_logger(__name__)


def _probe_writable(flag: str, path: str) -> None:
    """``path`` (a dir that exists) accepts a new file: tried, not inferred from mode
    bits, which say nothing for root, read-only mounts or /proc."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".greenroom-probe-", dir=path)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot create files there ({e.strerror}); choose a writable dir") from None
    os.close(fd)
    os.unlink(probe)


def _check_creatable_dir(flag: str, path: str) -> None:
    """``path`` is a dir, or can be made one: everything above it that exists is a
    writable dir."""
    path = os.path.abspath(path)
    if os.path.lexists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {path} exists and is not a directory; give a directory path")
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"{flag} {path}: {existing} is not a directory, so nothing can be created under it")
    _probe_writable(flag, existing)


def check_paths(config) -> None:
    """Kinds and writability of ``--save``, ``--load`` and ``--metrics`` (the disk dir's
    root is checked where ``OffloadConfig`` resolves it, ``greenroom.dirs.roots.check_root``)."""
    if config.save:
        save = os.path.abspath(config.save)
        _check_creatable_dir("--save", os.path.dirname(save))
        rotation.check_root(save)
    if config.load:
        load = os.path.abspath(config.load)
        leftovers = [p for p in (load + publish.NEW_SUFFIX, load + publish.OLD_SUFFIX) if os.path.lexists(p)]
        if not os.path.lexists(load) and not leftovers:
            raise ConfigError(f"--load {load}: no such checkpoint dir")
        if os.path.lexists(load) and not os.path.isdir(load):
            raise ConfigError(f"--load {load} is not a directory; give the dir a --save wrote")
        if os.path.isdir(load) and not os.access(load, os.R_OK | os.X_OK):
            raise ConfigError(f"--load {load}: not readable by uid {os.getuid()}")
    if config.metrics != "":
        metrics = os.path.abspath(config.metrics if config.metrics is not None else default_metrics())
        if os.path.isdir(metrics):
            raise ConfigError(f"--metrics {metrics} is a directory; give a file path")
        _check_creatable_dir("--metrics", os.path.dirname(metrics))
        _check_ours("--metrics", metrics)


def metrics_record(line: str) -> dict | None:
    """The record on ``line`` if it is one ``greenroom train`` writes (an object with its
    iteration number and its phases' events), else None."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if isinstance(record, dict) and type(record.get("iteration")) is int and isinstance(record.get("events"), list):
        return record
    return None


def _check_ours(flag: str, path: str) -> None:
    """A fresh run truncates the metrics file and a resumed one rewrites it, so a file
    that is there must be one ``greenroom train`` wrote: every line a record, but for a
    torn last line (a run killed mid-write). Anything else is the user's: refused."""
    if not os.path.isfile(path):
        return
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    for number, line in enumerate(lines, 1):
        # A record's start: a line the user wrote without a newline is still theirs.
        torn = number == len(lines) and not line.endswith("\n") and line.startswith('{"iteration": ')
        if line.strip() and not torn and metrics_record(line) is None:
            raise ConfigError(
                f"{flag} {path}: line {number} is not a greenroom train metrics record, so greenroom "
                "did not write this file; refusing to overwrite it: give another path"
            )


def check_save_space(save: str, need: int) -> None:
    """The new checkpoint is written beside the previous one, so it needs its full size free."""
    free = fs.free_bytes(os.path.abspath(save))
    if free < need:
        raise ConfigError(
            f"--save {save}: the checkpoint needs {fs.human_bytes(need)}, only {fs.human_bytes(free)} "
            "free there; free space or choose another dir"
        )


DEFAULT_METRICS = ".run/train-metrics.jsonl"


def default_metrics() -> str:
    """Where a run without ``--metrics`` writes (Note [one writer per metrics file]):
    ``.run/train-metrics.jsonl``, or ``.run/train-metrics-<job>.jsonl`` under a job id
    ``$GREENROOM_JOB_ID`` or ``$SLURM_JOB_ID`` gives (the one that names the rank dirs)."""
    job = os.environ.get("GREENROOM_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if not job:
        return DEFAULT_METRICS
    if not is_dir_name(job):
        raise ConfigError(
            f"the job id (from $GREENROOM_JOB_ID or $SLURM_JOB_ID) {job!r} cannot be part of the "
            "default --metrics file name (it has a /, or is . or ..): fix it, or pass --metrics PATH"
        )
    return f".run/train-metrics-{job}.jsonl"


@contextlib.contextmanager
def open_metrics(path: str | None, *, append: bool, resume_at: int = 0):
    """The metrics file ``path`` (None: the default), its dir created, held for the
    block as its one writer: yields ``(path, file)``, ``path`` the file written (the
    default moves aside while another run holds it). An OSError becomes a one-line error
    naming the file.
    A resumed run (``append``) first drops the records of iterations past ``resume_at``,
    the checkpoint's: a run killed after it logged them, and they are trained again now,
    so each iteration keeps one record (``greenroom report`` would plot both). A symlink
    is followed: the rewrite replaces its target, not the link.

    Note [one writer per metrics file]: two runs writing one file interleaved their
    records, or the second truncated the first's, and neither said so. So the writer
    holds ``publish.held`` on ``FILE.lock`` (the lock of a checkpoint dir, for one file)
    from before it touches the file until the run ends. A ``--metrics`` the user gave
    that another live run holds is refused in one line naming that run. The default is
    not refused: runs started from one dir without ``--metrics`` (test workers, jobs
    submitted from one dir) would then each fail but the first; while it is held, this
    run writes ``FILE`` with ``-pid<N>`` before ``.jsonl`` and says so. Under a
    scheduler's job id the default is that job's own file, so concurrent jobs never
    meet and a requeued job, which keeps its id, resumes into its own records."""
    given = path is not None
    path = path if given else default_metrics()
    with contextlib.ExitStack() as stack:
        try:
            _hold(stack, path)
        except publish.LockHeld as e:
            if given:
                raise ConfigError(
                    f"--metrics {path}: another run ({e.holder}) is writing it (it holds "
                    f"{_lock_path(path)}): give this run another --metrics path, or start it once "
                    "that run has ended"
                ) from None
            taken, path = path, f"{os.path.splitext(path)[0]}-pid{os.getpid()}.jsonl"
            _check_ours("--metrics", os.path.abspath(path))
            try:
                _hold(stack, path)
            except publish.LockHeld as again:
                raise ConfigError(
                    f"--metrics {path}: another run ({again.holder}) is writing it: pass this run "
                    "its own --metrics PATH"
                ) from None
            log.warning(
                f"{taken} is being written by another run ({e.holder}), so this run's metrics go to "
                f"{path} (--metrics PATH chooses)"
            )
        real = os.path.realpath(path)
        try:
            if append and os.path.isfile(real):
                _drop_records_past(real, resume_at)
            f = stack.enter_context(open(real, "a" if append else "w", encoding="utf-8"))
        except OSError as e:
            raise ConfigError(f"--metrics {real}: cannot open it for writing ({e.strerror})") from None
        yield path, f


def _lock_path(path: str) -> str:
    """The metrics file's lock, beside its target: two runs naming it through different links meet."""
    return os.path.realpath(path) + publish.LOCK_SUFFIX


def _hold(stack: contextlib.ExitStack, path: str) -> None:
    """Hold the writer's lock of the metrics file ``path`` until ``stack`` closes, its
    dir created first."""
    lock_path = _lock_path(path)
    try:
        os.makedirs(os.path.dirname(lock_path), exist_ok=True)
        stack.enter_context(publish.held(lock_path))
    except OSError as e:
        raise ConfigError(f"--metrics {path}: cannot create its lock file {lock_path} ({e.strerror})") from None


def _drop_records_past(path: str, iteration: int) -> None:
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    kept, dropped, torn = [], [], 0
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            torn += bool(line.strip())  # the last line of a run killed mid-write
            continue
        if isinstance(record, dict) and isinstance(record.get("iteration"), int) and record["iteration"] > iteration:
            dropped.append(record["iteration"])
        else:
            kept.append(line if line.endswith("\n") else line + "\n")
    if not dropped and not torn:
        return
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.chmod(tmp, os.stat(path).st_mode & 0o7777)  # the file keeps the mode it had
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    what = (
        [
            f"{len(dropped)} record(s) of iterations past the checkpoint's {iteration} ({min(dropped)}-{max(dropped)}: "
            "logged by a run that did not save them; they are trained again now)"
        ]
        if dropped
        else []
    )
    what += [f"{torn} torn line(s)"] if torn else []
    log.warning(f"--metrics {path}: dropped {' and '.join(what)}")


def check_fits(config, model, device) -> None:
    """The model and one rollout's batch fit on ``device`` (its free memory on CUDA, the
    host's RAM on the CPU). A lower bound, so a run that fits is never refused: the
    weights and grads at 2 bytes each, and the rollout's keys and values at 2 bytes for
    every token of the batch in every layer."""
    tokens = config.prompts * config.group_size * model.max_seq_len
    nbytes = 4 * model.num_params() + 4 * tokens * model.d_model * model.n_layers
    given = (
        f"--d-model {model.d_model} --n-layers {model.n_layers} --prompts {config.prompts} "
        f"--group-size {config.group_size} (sequences of {model.max_seq_len} tokens)"
    )
    check_device_bytes(
        "train",
        given,
        nbytes,
        device,
        default=None,
        counted="the weights, their grads and one rollout's keys and values, at least",
    )
