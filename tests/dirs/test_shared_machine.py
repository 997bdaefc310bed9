"""Shared machines: one owner per state dir whatever the entry point, and nothing greenroom
did not create is ever changed.

All real processes: two optimizers in one process, two processes and two torchrun ranks
on one plain ``state_dir``; a shared 1777 scratch, a root-owned 0755 dir opened by an
unprivileged user (``nobody``, through ``setpriv``) and a read-only mount (a bind mount
remounted read-only in a private mount namespace) under ``train``, ``doctor``, ``plan``,
``reclaim`` and the API. The privileged cases need root (to make a root-owned dir, drop to
``nobody`` and mount); elsewhere they skip saying so.
"""

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile

import pytest
import torch

import greenroom
from greenroom.dirs.rankdir import RankDir
from greenroom.errors import ConfigError, StorageError
from greenroom.io import fs
from greenroom.optim import StreamingAdam
from tests.cli_support import REPO, one_line_error

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "statedir_worker.py")
NOBODY = 65534
SMALL = [
    "--iterations",
    "1",
    "--prompts",
    "4",
    "--group-size",
    "2",
    "--minibatches",
    "1",
    "--d-model",
    "16",
    "--no-progress",
]
TRAIN_DISK = [
    "train",
    *SMALL,
    "--offload-train",
    "--offload-train-target",
    "disk",
    "--stream-optimizer-state-to-disk",
    "--offload-train-disk-dir",
]
# Launcher variables a CI runner may carry: the plain-path tests choose them themselves.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GREENROOM_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONPATH"] = os.path.join(REPO, "runtime") + os.pathsep + REPO
    env.update(extra)
    return env


def _train_pair(params_seed: int = 0):
    torch.manual_seed(params_seed)
    ours = [torch.nn.Parameter(torch.randn(200, 50)), torch.nn.Parameter(torch.randn(3000))]
    return ours, [torch.nn.Parameter(p.detach().clone()) for p in ours]


def _steps(opt, reference, ours, theirs, n=3):
    for step in range(n):
        g = torch.Generator().manual_seed(step)
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        opt.step()
        reference.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


# -- one owner per state dir --------------------------------------------------------------
def test_a_second_optimizer_on_one_plain_path_in_one_process_is_refused_in_one_line(disk_dir, monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    root = os.path.join(disk_dir, "optim")
    ours, theirs = _train_pair()
    first = StreamingAdam(ours, lr=1e-2, state_dir=root, bucket_numel=4000, chunk_mb=1, resident_numel=0)
    rank_dir = os.path.dirname(first.state_dir)
    assert rank_dir.startswith(root + os.sep) and rank_dir.endswith(os.path.join("optim", "rank00000"))
    with pytest.raises(StorageError) as refused:
        StreamingAdam(_train_pair(1)[0], lr=1e-2, state_dir=root, bucket_numel=4000, chunk_mb=1)
    message = str(refused.value)
    assert "\n" not in message and rank_dir in message
    assert f"pid {os.getpid()} on {socket.gethostname()}" in message
    reference = torch.optim.AdamW(theirs, lr=1e-2, foreach=first.foreach, fused=first.fused)
    _steps(first, reference, ours, theirs)  # the refused one touched nothing of the first's
    first.close()
    assert os.listdir(root) == [], "close() leaves nothing behind under the user's dir"


def test_a_plain_path_on_tmpfs_is_refused_in_one_line_and_nothing_is_made():
    if not (os.path.isdir("/dev/shm") and fs.is_memory_backed("/dev/shm")):
        pytest.skip("no tmpfs at /dev/shm")
    path = tempfile.mkdtemp(prefix="greenroom-test-", dir="/dev/shm")  # ours: a fresh dir on tmpfs
    try:
        with pytest.raises(ConfigError) as refused:
            StreamingAdam(_train_pair()[0], state_dir=os.path.join(path, "optim"))
        message = str(refused.value)
        assert "\n" not in message and "keeps the data in RAM" in message and path in message
        assert os.listdir(path) == []
    finally:
        shutil.rmtree(path)


def test_two_optimizers_on_one_rank_dir_get_a_subdir_each(disk_dir):
    with RankDir(disk_dir, job="j", role="actor") as rank_dir:
        pairs = [_train_pair(seed) for seed in (0, 1)]
        opts = [StreamingAdam(ours, lr=1e-2, state_dir=rank_dir, bucket_numel=4000, chunk_mb=1) for ours, _ in pairs]
        assert [os.path.basename(o.state_dir) for o in opts] == ["optim", "optim-2"]
        for opt, (ours, theirs) in zip(opts, pairs):
            reference = torch.optim.AdamW(theirs, lr=1e-2, foreach=opt.foreach, fused=opt.fused)
            _steps(opt, reference, ours, theirs)
        for opt in opts:
            opt.close()


def test_a_dir_named_by_path_and_one_handed_out_by_the_rank_dir_never_coincide(disk_dir):
    """An owner that names ``<rank dir>/optim`` first and one handed the RankDir after it
    get two dirs, each stepping like AdamW; every other spelling or nesting of a live
    claim (through a symlinked root, inside it, around it) is refused in one line."""
    link = os.path.join(disk_dir, "root-link")
    os.symlink(disk_dir, link)
    with RankDir(disk_dir, job="j", role="actor") as rank_dir:
        pairs = [_train_pair(seed) for seed in (0, 1)]
        by_path = StreamingAdam(
            pairs[0][0], lr=1e-2, state_dir=os.path.join(rank_dir.path, "optim"), bucket_numel=4000, chunk_mb=1
        )
        handed = StreamingAdam(pairs[1][0], lr=1e-2, state_dir=rank_dir, bucket_numel=4000, chunk_mb=1)
        assert os.path.basename(handed.state_dir) == "optim-2"
        for opt, (ours, theirs) in zip((by_path, handed), pairs):
            reference = torch.optim.AdamW(theirs, lr=1e-2, foreach=opt.foreach, fused=opt.fused)
            _steps(opt, reference, ours, theirs)
        via_link = os.path.join(link, os.path.relpath(by_path.state_dir, disk_dir))
        for spelling in (via_link, os.path.join(by_path.state_dir, "inner"), rank_dir.path):
            with pytest.raises(StorageError) as refused:
                StreamingAdam(_train_pair(2)[0], state_dir=spelling, bucket_numel=4000, chunk_mb=1)
            message = str(refused.value)
            assert "\n" not in message and "another owner in this process" in message
        assert not os.path.exists(os.path.join(by_path.state_dir, "inner")), "a refused claim makes nothing"
        for opt in (by_path, handed):
            opt.close()


def _worker(root, mode, env):
    return subprocess.Popen(
        [sys.executable, WORKER, root, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _finish(proc) -> str:
    out, err = proc.communicate("\n", timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return out


def test_two_processes_on_one_plain_path_each_own_a_dir_and_match_adamw(disk_dir):
    root = os.path.join(disk_dir, "optim")
    first, second = _worker(root, "hold", _env()), _worker(root, "hold", _env())
    dirs = [first.stdout.readline().strip(), second.stdout.readline().strip()]
    assert all(d.startswith(root + os.sep) for d in dirs) and dirs[0] != dirs[1], dirs
    assert all(os.path.isdir(d) for d in dirs), "both own their dir at the same time"
    for proc in (first, second):
        assert _finish(proc).splitlines()[-1] == "bit-identical"
    assert os.listdir(root) == []


def test_a_second_process_of_the_same_job_and_rank_is_refused_in_one_line(disk_dir):
    root = os.path.join(disk_dir, "optim")
    env = _env(GREENROOM_JOB_ID="job7")
    holder = _worker(root, "hold", env)
    state_dir = holder.stdout.readline().strip()
    second = _worker(root, "hold", env)
    out, err = second.communicate(timeout=300)
    assert second.returncode == 3, err[-3000:]
    assert out.count("\n") == 1 and "Traceback" not in err
    assert out.startswith(
        f"refused: {os.path.dirname(state_dir)} is held by a live process (pid {holder.pid} on {socket.gethostname()})"
    ), out
    assert _finish(holder).splitlines()[-1] == "bit-identical"
    assert os.listdir(root) == []


def test_two_torchrun_ranks_on_one_plain_path_each_own_a_dir_and_match_adamw(disk_dir):
    root = os.path.join(disk_dir, "optim")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            WORKER,
            root,
            "barrier",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(OMP_NUM_THREADS="1"),
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    dirs = sorted(line for line in lines if line.startswith(root))
    assert [os.path.basename(os.path.dirname(d)) for d in dirs] == ["rank00000", "rank00001"], lines
    assert len({os.path.dirname(os.path.dirname(d)) for d in dirs}) == 1, "one job dir for the job's ranks"
    assert lines.count("bit-identical") == 2, lines
    assert os.listdir(root) == []


# -- never change what greenroom did not create -----------------------------------------------
def test_benches_and_doctor_work_in_a_rank_dir_of_their_own_and_leave_a_shared_root_as_it_was(disk_dir, capsys):
    from greenroom.cli import main as cli

    root = os.path.join(disk_dir, "scratch")
    os.mkdir(root)
    os.chmod(root, 0o1777)
    before = _state(root)
    for argv in (
        ["bench", "disk", root, "--size", "4MiB", "--chunk-mb", "1", "--json"],
        [
            "bench",
            "codec",
            "--compression",
            "zstd",
            "--state",
            "random",
            "--size",
            "2MiB",
            "--threads",
            "1",
            "--dir",
            root,
            "--json",
        ],
        [
            "bench",
            "stream",
            "--params",
            "20000",
            "--param-numel",
            "5000",
            "--bucket-numel",
            "10000",
            "--steps",
            "1",
            "--chunk-mb",
            "1",
            "--raw-size",
            "1MiB",
            "--dir",
            root,
            "--json",
        ],
        ["doctor", root, "--chunk-mb", "1"],
    ):
        assert cli.main(argv) == 0, argv
        assert _state(root) == before, f"{argv[:2]} changed the shared root or left something in it"
    capsys.readouterr()


def test_streaming_checkpoint_io_refuses_a_dir_it_cannot_write_in_one_line(tmp_path):
    pytest.importorskip("lightning", reason="the test extra pins lightning")
    from greenroom.errors import ConfigError
    from greenroom.optim.lightning import StreamingCheckpointIO

    with pytest.raises(ConfigError) as refused:  # /proc takes no new dir, not even root's
        StreamingCheckpointIO().save_checkpoint({"x": torch.ones(2)}, "/proc/greenroom-ckpt/epoch=0.ckpt")
    assert "\n" not in str(refused.value) and "/proc/greenroom-ckpt cannot be made" in str(refused.value)
    StreamingCheckpointIO().save_checkpoint({"x": torch.ones(2)}, str(tmp_path / "new" / "epoch=0.ckpt"))
    assert os.listdir(tmp_path / "new") == ["epoch=0.ckpt"]


def _shared_base():
    """A world-traversable scratch dir on a real disk, made by the test (so it may set its modes)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: to make a root-owned dir, drop to another user (setpriv) and mount read-only")
    for tool in ("setpriv", "unshare", "mount"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not found (util-linux)")
    for parent in (tempfile.gettempdir(), os.path.join(REPO, ".run")):
        os.makedirs(parent, exist_ok=True)
        if fs.is_memory_backed(parent):
            continue
        base = tempfile.mkdtemp(prefix="greenroom-shared-", dir=parent)
        os.chmod(base, 0o755)
        if _traversable_by_others(base):
            return base
        os.rmdir(base)
    pytest.skip("no disk-backed dir that another user can reach (its parents are not o+x)")


def _traversable_by_others(path: str) -> bool:
    path = os.path.realpath(path)
    while True:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)


def _interpreter() -> str:
    """A Python the unprivileged user can run: this one, or the system's of the same version."""
    for candidate in (os.path.realpath(sys.executable), f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"):
        if (
            os.path.exists(candidate)
            and _traversable_by_others(os.path.dirname(candidate))
            and os.stat(candidate).st_mode & stat.S_IXOTH
        ):
            return candidate
    pytest.skip("no Python interpreter that another user can run (it lives under a private home)")


def _site_path() -> str:
    """Where greenroom and its dependencies are, for an interpreter that is not this venv's."""
    entries = [os.path.dirname(os.path.dirname(greenroom.__file__)), REPO]
    entries += [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    return os.pathsep.join(entries)


class Runner:
    """Runs greenroom (``cli`` args or a ``python`` snippet) as ``user``, optionally with
    ``readonly`` bind-mounted read-only in a private mount namespace."""

    def __init__(self, base: str):
        self.home = os.path.join(base, "home")  # the unprivileged user's HOME and cwd
        os.mkdir(self.home)
        os.chown(self.home, NOBODY, NOBODY)
        self.python = _interpreter()

    def __call__(self, *, user: str, cli=None, code=None, readonly=None) -> subprocess.CompletedProcess:
        argv = [self.python, "-m", "greenroom.cli.main", *cli] if cli is not None else [self.python, "-c", code]
        env = {"PATH": "/usr/bin:/bin", "HOME": self.home, "PYTHONPATH": _site_path(), "OMP_NUM_THREADS": "1"}
        argv = ["env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv]
        if user == "nobody":
            argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
        if readonly is not None:
            script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", readonly, *argv]
        return subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=self.home)


def _state(path: str) -> tuple:
    st = os.stat(path)
    return stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, sorted(os.listdir(path))


API_REFUSALS = """
import sys
from greenroom import actor
from greenroom.config import OffloadConfig
from greenroom.errors import ConfigError
from greenroom.optim import StreamingAdam
import torch

root, elsewhere = sys.argv[1], sys.argv[2]
config = OffloadConfig(offload_train=True, offload_train_target="disk", offload_train_disk_dir=elsewhere,
                       stream_optimizer_state_to_disk=True)
attempts = {
    "StreamingAdam": lambda: StreamingAdam([torch.nn.Parameter(torch.ones(8))], state_dir=root),
    "build_offloader": lambda: actor.build_offloader(config, root),
}
try:
    from greenroom.megatron import streaming
    attempts["megatron streaming"] = lambda: streaming(config, root).__enter__()
except ImportError:
    pass
for name, attempt in attempts.items():
    try:
        attempt()
        print(f"{name}: ACCEPTED")
    except ConfigError as e:
        print(f"{name}: ConfigError: {e}")
"""


def _assert_refused_everywhere(run, root: str, problem: str, **how) -> None:
    """train, doctor and plan exit 2 with the same one line; the API raises ConfigError with it."""
    for cli in (
        TRAIN_DISK + [root],
        ["doctor", root, "--no-probe"],
        [
            "plan",
            "--params",
            "1e6",
            "--offload-train",
            "--offload-train-target",
            "disk",
            "--offload-train-disk-dir",
            root,
        ],
    ):
        line = one_line_error(run(cli=cli, **how))
        assert f"{root} {problem}" in line, (cli[0], line)
    api = run(code=API_REFUSALS.replace("sys.argv[1], sys.argv[2]", f"{root!r}, {run.home!r}"), **how)
    assert api.returncode == 0, api.stderr[-3000:]
    lines = api.stdout.splitlines()
    assert len(lines) >= 2 and all(": ConfigError: " in line and f"{root} {problem}" in line for line in lines), lines


@pytest.fixture
def shared(request):
    base = _shared_base()
    yield base, Runner(base)
    shutil.rmtree(base)  # the read-only mounts lived in the children's own namespaces


def test_a_shared_1777_root_keeps_its_mode_for_root_and_for_another_user(shared):
    base, run = shared
    root = os.path.join(base, "scratch")
    os.mkdir(root)
    os.chmod(root, 0o1777)
    before = _state(root)
    for user in ("root", "nobody"):
        proc = run(user=user, cli=TRAIN_DISK + [root, "--metrics", os.path.join(run.home, f"{user}.jsonl")])
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert _state(root) == before, f"as {user}: the shared root changed"
    # A crashed owner (plain state_dir, as nobody) leaves a dir only reclaim may remove.
    crash = run(
        user="nobody",
        code=f"import runpy, sys; sys.argv = ['w', {root!r}, 'crash']; runpy.run_path({WORKER!r}, run_name='__main__')",
    )
    left = crash.stdout.strip()
    assert crash.returncode == -9 or crash.returncode == 137, crash.stderr[-3000:]
    assert left.startswith(root) and os.path.isdir(left)
    assert os.stat(left).st_uid == NOBODY and stat.S_IMODE(os.stat(os.path.dirname(left)).st_mode) == 0o700
    reclaim = run(user="root", cli=["reclaim", root])
    assert reclaim.returncode == 0, reclaim.stdout + reclaim.stderr
    assert _state(root)[:3] == before[:3], "reclaim changed the shared root"
    assert not os.path.exists(os.path.dirname(left)), "reclaim removed the dead owner's rank dir"
    assert [files for _, _, files in os.walk(root) if files] == [], "no file of the dead owner is left"


def test_a_root_owned_0755_root_is_refused_for_another_user_in_one_line(shared):
    base, run = shared
    root = os.path.join(base, "rootowned")
    os.mkdir(root, 0o755)
    os.chmod(root, 0o755)
    before = _state(root)
    _assert_refused_everywhere(run, root, f"is not writable by uid {NOBODY}", user="nobody")
    missing = os.path.join(root, "sub")
    line = one_line_error(run(user="nobody", cli=TRAIN_DISK + [missing]))
    assert f"{missing} cannot be made by uid {NOBODY}: {root} takes no new directory" in line, line
    reclaim = run(user="nobody", cli=["reclaim", root])
    assert reclaim.returncode == 0, reclaim.stdout + reclaim.stderr
    assert _state(root) == before


def test_a_read_only_root_is_refused_even_for_root_in_one_line(shared):
    base, run = shared
    root = os.path.join(base, "readonly")
    os.mkdir(root)
    os.chmod(root, 0o1777)  # writable by mode: only the mount says no
    probe = run(user="root", code="print('mounted')", readonly=root)
    if probe.returncode != 0:
        pytest.skip(f"cannot bind-mount read-only here: {probe.stderr.strip()[-300:]}")
    before = _state(root)
    _assert_refused_everywhere(
        run,
        root,
        "is not writable by uid 0: it takes no new directory (read-only filesystem)",
        user="root",
        readonly=root,
    )
    assert _state(root) == before
