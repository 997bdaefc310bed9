"""``greenroom train --save`` under SIGKILL and damage: real processes and files.

Each test kills a run that resumes from a 2-iteration checkpoint and saves over it, at one
named point (``greenroom.faults``, or a syscall via strace), then reclaims and resumes.
The resumed run must end bit-identical to the same run done in one go, or be refused in
one line; never a silently different result.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from greenroom.cli import main as cli
from greenroom.dirs.reclaim import reclaim
from greenroom.train import rotation
from tests.cli_support import greenroom_forked
from tests.conftest import require_tool
from tests.train.test_loop import REPO, env, streaming_available

pytestmark = pytest.mark.skipif(not streaming_available(), reason="needs greenroom.optim.StreamingAdam")

# bf16 params: every param streams (fp32 masters on disk), so the streamed step does I/O.
FLAGS = [
    "--prompts",
    "8",
    "--group-size",
    "4",
    "--minibatches",
    "2",
    "--d-model",
    "32",
    "--no-progress",
    "--dtype",
    "bf16",
    "--offload-train",
    "--offload-train-target",
    "disk",
    "--stream-optimizer-state-to-disk",
]


def run(args, *, root, metrics, kill_at=None, prefix=()):
    e = env()
    if kill_at:
        e["GREENROOM_TEST_KILL_AT"] = kill_at
    argv = ["train", *FLAGS, "--offload-train-disk-dir", root, "--metrics", metrics, *args]
    if not prefix:  # a process of its own, forked from a Python that has imported torch already
        return greenroom_forked(*argv, env=e, timeout=300, cwd=REPO)
    cmd = [*prefix, sys.executable, "-m", "greenroom.cli.main", *argv]
    return subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=300, cwd=REPO)


def newest(ckpt):
    """The checkpoint dir a load of ``ckpt`` tries first: a root's newest complete iteration dir."""
    return rotation.candidates(ckpt)[0]


def state_of(ckpt):
    """Every tensor and byte of a checkpoint's state (weights, streamed files, resident
    state); ``ckpt`` a root (its newest iteration) or one checkpoint dir."""
    ckpt = newest(ckpt)
    rank = os.path.join(ckpt, "rank00000")
    out = {f"model.{k}": v for k, v in torch.load(os.path.join(rank, "model.pt"), weights_only=True).items()}
    resident = torch.load(os.path.join(rank, "optim", "resident.pt"), weights_only=True)
    out.update({f"step.{k}": v for k, v in resident["steps"].items()})
    for name in sorted(os.listdir(os.path.join(rank, "optim"))):
        if name.startswith("bucket-"):
            with open(os.path.join(rank, "optim", name), "rb") as f:
                out[name] = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
    meta = json.load(open(os.path.join(ckpt, "meta.json")))
    out["iteration"] = torch.tensor(meta["iteration"])
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 4-iteration run, and a 2-iteration checkpoint to resume from."""
    base = str(tmp_path_factory.mktemp("reference"))
    root, metrics = os.path.join(base, "offload"), os.path.join(base, "m.jsonl")
    straight, half = os.path.join(base, "straight"), os.path.join(base, "half")
    for iterations, save in (("4", straight), ("2", half)):
        result = run(["--iterations", iterations, "--save", save], root=root, metrics=metrics)
        assert result.returncode == 0, result.stderr
    return state_of(straight), half


def kill_and_resume(disk_dir, reference, point, *, prefix=(), extra=()):
    expected, half = reference
    ckpt = os.path.join(disk_dir, "ckpt")
    shutil.copytree(half, ckpt)
    root, metrics = os.path.join(disk_dir, "offload"), os.path.join(disk_dir, "m.jsonl")
    args = ["--iterations", "4", "--load", ckpt, "--save", ckpt, *extra]
    killed = run(args, root=root, metrics=metrics, kill_at=point, prefix=prefix)
    assert killed.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), (killed.returncode, killed.stderr[-2000:])
    assert os.listdir(root), "a SIGKILLed run leaves its per-rank dir for reclaim"
    reclaim(root)
    assert os.listdir(root) == []
    resumed = run(args, root=root, metrics=metrics)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same(expected, state_of(ckpt))
    assert sorted(os.listdir(disk_dir)) == ["ckpt", "m.jsonl", "offload"], "a leftover beside the checkpoint"
    return resumed


@pytest.mark.parametrize("point", ["sync@2", "sleep@2", "rollout", "wake@2", "train-step@3"])
def test_killed_during_the_loop_resumes_bit_identically(disk_dir, reference, point):
    resumed = kill_and_resume(disk_dir, reference, point)
    assert "resuming at iteration 3" in resumed.stdout


@pytest.mark.parametrize(
    "point,said",
    [
        ("instep-bucket", "an unfinished save"),  # the last step writing the streamed state into the staged save
        ("instep-streamed", "an unfinished save"),
        ("save-model", "an unfinished save"),
        ("save-optim", "an unfinished save"),
        ("save-manifest", "an unfinished save"),
        ("save-meta", "an unfinished save"),
        ("save-staged@2", "complete but not yet moved into place"),  # @1 is the optimizer's own
    ],
)
def test_killed_during_the_save_resumes_bit_identically_and_says_what_it_settled(disk_dir, reference, point, said):
    resumed = kill_and_resume(disk_dir, reference, point)
    assert said in resumed.stderr
    finished = point == "save-staged@2"
    # A save that completed is kept (nothing left to train); an unfinished one is dropped.
    assert ("resuming at iteration 5" if finished else "resuming at iteration 3") in resumed.stdout


def test_async_saves_every_iteration_end_bit_identical(disk_dir, reference):
    """--save-interval 1 --async-save: a checkpoint after every iteration, each published
    beside the next iteration; the last one equals the uninterrupted run's."""
    expected, _ = reference
    ckpt, root = os.path.join(disk_dir, "ckpt"), os.path.join(disk_dir, "offload")
    done = run(
        ["--iterations", "4", "--save", ckpt, "--save-interval", "1", "--async-save"],
        root=root,
        metrics=os.path.join(disk_dir, "m.jsonl"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for it in range(1, 5):
        assert f"saved iteration {it} to {ckpt}/iter_{it:07d} (published in the background)" in done.stdout
    assert_same(expected, state_of(ckpt))


@pytest.mark.parametrize("point", ["save-meta@2", "save-staged@4", "instep-streamed@2"])
def test_killed_during_an_async_save_resumes_bit_identically(disk_dir, reference, point):
    """With --save-interval 1 --async-save each save is published on a thread beside the
    next iteration. Killed in iteration 4's publish before (save-meta@2) or after
    (save-staged@4, @3 being the optimizer's own) its generation record, or in the step
    writing its streamed state: the resume settles what was left and ends bit-identical."""
    resumed = kill_and_resume(disk_dir, reference, point, extra=["--save-interval", "1", "--async-save"])
    assert "resuming at iteration" in resumed.stdout


def test_killed_between_the_two_renames_without_rename_exchange(disk_dir, reference):
    """A save of an iteration already there (a resume with nothing left to train) replaces
    its dir. Where renameat2(RENAME_EXCHANGE) fails (strace makes it EINVAL, as on a
    filesystem without it), the swap takes two renames; a kill between them leaves the
    new checkpoint at iter_N.new and the old at iter_N.old, and the resume finishes the swap."""
    strace = require_tool("strace")
    expected, half = reference
    ckpt = os.path.join(disk_dir, "ckpt")
    shutil.copytree(half, ckpt)
    root, metrics = os.path.join(disk_dir, "offload"), os.path.join(disk_dir, "m.jsonl")
    killed = run(
        ["--iterations", "2", "--load", ckpt, "--save", ckpt],
        root=root,
        metrics=metrics,
        kill_at="save-aside",
        prefix=[strace, "-f", "-qq", "-o", "/dev/null", "-e", "trace=renameat2", "-e", "inject=renameat2:error=EINVAL"],
    )
    assert killed.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), (killed.returncode, killed.stderr[-2000:])
    assert sorted(os.listdir(ckpt)) == ["iter_0000002.new", "iter_0000002.old", rotation.POINTER]
    reclaim(root)
    resumed = run(["--iterations", "4", "--load", ckpt, "--save", ckpt], root=root, metrics=metrics)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "complete but not yet moved into place" in resumed.stderr and "resuming at iteration 3" in resumed.stdout
    assert_same(expected, state_of(ckpt))


def test_killed_at_a_write_of_the_streamed_step(disk_dir, reference):
    """SIGKILL from the kernel side (strace inject) at the 6th pwrite64 of any thread (the
    engine's I/O threads, twice as many as its buffers, make 10-15 each in two
    iterations): mid-I/O of the sleep, the streamed step or the save, wherever it falls;
    the property must hold there too."""
    strace = require_tool("strace")
    kill_and_resume(
        disk_dir,
        reference,
        None,
        prefix=[
            strace,
            "-f",
            "-qq",
            "-o",
            "/dev/null",
            "-e",
            "trace=pwrite64",
            "-e",
            "inject=pwrite64:signal=SIGKILL:when=6",
        ],
    )


# -- damage and malformed files: one line naming the file ------------------------------
def damaged(disk_dir, reference, change, capsys):
    """The CLI in this process (a fresh interpreter per case would cost seconds each):
    exit 2, and stderr's one error line is returned. An exception would fail the test."""
    _, half = reference
    ckpt = os.path.join(disk_dir, "ckpt")
    shutil.copytree(half, ckpt)
    change(newest(ckpt))
    root = os.path.join(disk_dir, "offload")
    capsys.readouterr()
    rc = cli.main(
        [
            "train",
            *FLAGS,
            "--offload-train-disk-dir",
            root,
            "--metrics",
            os.path.join(disk_dir, "m.jsonl"),
            "--iterations",
            "4",
            "--load",
            ckpt,
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2, err
    [line] = [ln for ln in err.splitlines() if "error:" in ln]
    assert os.listdir(root) == []
    return line


def flip(path, offset=None):
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(size // 2 if offset is None else offset)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))


def truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


def rewrite_json(path, edit):
    data = json.load(open(path))
    edit(data)
    json.dump(data, open(path, "w"))


R = "rank00000"
DAMAGE = {
    "model.pt flipped": (lambda c: flip(os.path.join(c, R, "model.pt")), f"{R}/model.pt: checksum"),
    "model.pt truncated": (lambda c: truncate(os.path.join(c, R, "model.pt")), f"{R}/model.pt: "),
    "model.pt missing": (lambda c: os.unlink(os.path.join(c, R, "model.pt")), f"{R}/model.pt is missing"),
    "bucket flipped": (lambda c: flip(os.path.join(c, R, "optim", "bucket-00000.bin")), "bucket-00000.bin: checksum"),
    "bucket missing": (
        lambda c: os.unlink(os.path.join(c, R, "optim", "bucket-00000.bin")),
        "bucket-00000.bin is missing",
    ),
    "resident.pt flipped": (lambda c: flip(os.path.join(c, R, "optim", "resident.pt")), "resident.pt: checksum"),
    "optim manifest flipped": (
        lambda c: flip(os.path.join(c, R, "optim", "manifest.json")),
        "optim/manifest.json: checksum",
    ),
    "rank manifest deleted": (
        lambda c: os.unlink(os.path.join(c, R, "manifest.json")),
        f"{R}/manifest.json is missing",
    ),
    "rank manifest without files": (
        lambda c: rewrite_json(os.path.join(c, R, "manifest.json"), lambda d: d.pop("files")),
        f"{R}/manifest.json: ",
    ),
    "meta without iteration": (
        lambda c: rewrite_json(os.path.join(c, "meta.json"), lambda d: d.pop("iteration")),
        "meta.json: ",
    ),
    "meta not json": (
        lambda c: open(os.path.join(c, "meta.json"), "w").write("{not json"),
        "meta.json: not valid JSON",
    ),
    "meta binary": (
        lambda c: open(os.path.join(c, "meta.json"), "wb").write(b"\xff\xfe\x00garbage"),
        "meta.json: not valid JSON",
    ),
    "meta iteration changed": (
        lambda c: rewrite_json(os.path.join(c, "meta.json"), lambda d: d.update(iteration=1)),
        "meta.json: checksum",
    ),
    "meta deleted": (lambda c: os.unlink(os.path.join(c, "meta.json")), "meta.json is missing"),
    "generation deleted": (lambda c: os.unlink(os.path.join(c, "generation.json")), "generation.json"),
    "rank dir deleted": (lambda c: shutil.rmtree(os.path.join(c, R)), f"{R}/manifest.json is missing"),
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_a_damaged_checkpoint_is_refused_in_one_line_naming_the_file(disk_dir, reference, name, capsys):
    change, expected = DAMAGE[name]
    line = damaged(disk_dir, reference, change, capsys)
    assert expected in line, line


# -- errors while saving and cleaning up ----------------------------------------------
@pytest.fixture
def full_fs(tmp_path):
    """A 256 KiB tmpfs (root only): a filesystem that runs out of space."""
    path = str(tmp_path / "full")
    os.makedirs(path)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", path], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    yield path
    subprocess.run(["umount", path], check=True)


def test_save_to_a_filesystem_without_room_is_refused_before_training(disk_dir, full_fs, capsys):
    root = os.path.join(disk_dir, "offload")
    rc = cli.main(
        [
            "train",
            *FLAGS,
            "--iterations",
            "1",
            "--d-model",
            "128",
            "--offload-train-disk-dir",
            root,
            "--metrics",
            os.path.join(disk_dir, "m.jsonl"),
            "--save",
            os.path.join(full_fs, "ckpt"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "the checkpoint needs" in err and "free there" in err, err
    assert os.listdir(full_fs) == [] and not os.path.exists(os.path.join(disk_dir, "m.jsonl"))


def test_enospc_while_writing_names_the_file_and_leaves_no_partial_file(full_fs):
    from greenroom.errors import StorageError
    from greenroom.io.publish import torch_save

    path = os.path.join(full_fs, "model.pt")
    with pytest.raises(StorageError, match=f"{path}: writing the checkpoint failed: No space left on device"):
        torch_save({"w": torch.zeros(1 << 20)}, path)
    assert os.listdir(full_fs) == []


def test_a_cleanup_error_is_added_to_the_original_never_replaces_it(disk_dir):
    from greenroom.config import OffloadConfig
    from greenroom.train.config import TrainConfig
    from greenroom.train.model import ModelConfig
    from greenroom.train.task import VOCAB_SIZE, TaskConfig
    from greenroom.train.trainer import Trainer

    task = TaskConfig()
    trainer = Trainer(
        TrainConfig(iterations=1, metrics=os.path.join(disk_dir, "m.jsonl"), progress=False),
        offload=OffloadConfig(),
        task=task,
        model=ModelConfig(vocab_size=VOCAB_SIZE, d_model=16, n_layers=1, n_heads=2, max_seq_len=task.seq_len),
    )

    def failing_cleanup():
        raise OSError(5, "Input/output error", "offload/state.bin")

    with pytest.raises(RuntimeError, match="the original failure") as info:
        with trainer:
            trainer._stack.callback(failing_cleanup)
            raise RuntimeError("the original failure")
    assert info.value.__notes__ == [
        "then, while cleaning up: OSError: [Errno 5] Input/output error: 'offload/state.bin'"
    ]


def test_enospc_while_copying_a_bucket_file_names_both_files(disk_dir, full_fs):
    from greenroom.errors import StorageError
    from greenroom.optim.checkpoint.filecopy import copy_file

    src, dst = os.path.join(disk_dir, "bucket-00000.bin"), os.path.join(full_fs, "bucket-00000.bin")
    with open(src, "wb") as f:
        f.write(os.urandom(1 << 20))
    with pytest.raises(StorageError, match=f"copying {src} to {dst} failed: No space left on device"):
        copy_file(src, dst, 1 << 20)
