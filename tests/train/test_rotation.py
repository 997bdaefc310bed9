"""``greenroom train --save ROOT``: iteration dirs, the pointer, retention, and the last
verified checkpoint never lost (``greenroom.train.rotation``). Real processes and files;
kills and byte flips at named points (``greenroom.faults``).
"""

import os
import re
import shutil
import signal
import subprocess

import pytest

from greenroom.train import rotation
from tests.faults.test_save_faults import JOB, copy_of, one_line, resume, start
from tests.train.test_faults import assert_same, reference, run, state_of  # noqa: F401 (a fixture)


def good_iterations(ckpt):
    return rotation.iterations(ckpt)


def test_a_save_writes_iteration_dirs_a_pointer_and_keeps_the_last_two(disk_dir, reference):
    expected, _ = reference
    ckpt, root = os.path.join(disk_dir, "ckpt"), os.path.join(disk_dir, "offload")
    done = run(
        ["--iterations", "4", "--save", ckpt, "--save-interval", "1"],
        root=root,
        metrics=os.path.join(disk_dir, "m.jsonl"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for it in range(1, 5):
        assert f"saved iteration {it} to {ckpt}/iter_{it:07d}\n" in done.stdout
    assert sorted(os.listdir(ckpt)) == ["iter_0000003", "iter_0000004", rotation.POINTER]
    assert open(os.path.join(ckpt, rotation.POINTER)).read() == "4\n"
    assert_same(expected, state_of(os.path.join(ckpt, "iter_0000004")))
    # --load DIR/iter_N loads that one, not the newest.
    older = run(
        ["--iterations", "4", "--load", os.path.join(ckpt, "iter_0000003")],
        root=root,
        metrics=os.path.join(disk_dir, "m2.jsonl"),
    )
    assert older.returncode == 0 and "resuming at iteration 4" in older.stdout, older.stderr[-2000:]


def test_keep_last_one_leaves_only_the_newest(disk_dir, reference):
    ckpt, root = os.path.join(disk_dir, "ckpt"), os.path.join(disk_dir, "offload")
    done = run(
        ["--iterations", "3", "--save", ckpt, "--save-interval", "1", "--keep-last", "1"],
        root=root,
        metrics=os.path.join(disk_dir, "m.jsonl"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(os.listdir(ckpt)) == ["iter_0000003", rotation.POINTER]


def test_a_byte_flipped_in_a_linked_live_file_before_the_publish_never_loses_the_previous_checkpoint(
    disk_dir, reference
):
    """The save hard-links the live bucket file the step just wrote (optim.checkpoint.instep); a byte
    flipped in it then is in the checkpoint too. The run's last checkpoint must not
    replace the previous good one on trust: its read-back finds the flip, drops it in one
    line and the run ends with an error naming the iteration to resume from; the resume
    loads that one and ends bit-identical to the uninterrupted run."""
    expected, half = reference
    ckpt, root, metrics = copy_of(half, disk_dir)
    proc = start(
        ["--iterations", "4", "--load", ckpt, "--save", ckpt], root=root, metrics=metrics, stop_at="bucket-linked"
    )
    live = os.path.join(root, JOB, "actor", "rank00000", "optim", "bucket-00000.bin")
    assert os.stat(live).st_nlink == 2, "the checkpoint's file is a link to the live one"
    with open(live, "r+b") as f:
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0x04]))
    failed = resume(proc)
    one_line(
        failed,
        r"the checkpoint of iteration 4 failed its verification and was dropped; resume from "
        r"iteration 2",
    )
    assert re.search(r"iteration 4 failed its verification: .*bucket-00000\.bin: checksum mismatch", failed.stderr)
    assert good_iterations(ckpt) == [2]
    resumed = run(["--iterations", "4", "--load", ckpt, "--save", ckpt], root=root, metrics=metrics)
    assert resumed.returncode == 0 and "resuming at iteration 3" in resumed.stdout, resumed.stderr[-3000:]
    assert_same(expected, state_of(ckpt))


def test_a_checkpoint_corrupted_after_its_publish_is_dropped_and_the_load_falls_back(disk_dir, reference):
    expected, half = reference
    ckpt, root, metrics = copy_of(half, disk_dir)
    done = run(
        ["--iterations", "4", "--load", ckpt, "--save", ckpt, "--save-interval", "1"], root=root, metrics=metrics
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert good_iterations(ckpt) == [4, 3]
    with open(os.path.join(ckpt, "iter_0000004", "rank00000", "optim", "bucket-00000.bin"), "r+b") as f:
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0x01]))
    resumed = run(["--iterations", "4", "--load", ckpt, "--save", ckpt], root=root, metrics=metrics)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(r"iter_0000004 is damaged, skipped: .*bucket-00000\.bin: checksum mismatch", resumed.stderr)
    assert "dropped iter_0000004, loading the newest good one before it, iter_0000003" in resumed.stderr
    assert "resuming at iteration 4" in resumed.stdout
    assert_same(expected, state_of(ckpt))


@pytest.mark.parametrize(
    "point",
    ["save-staged@2", "save-staged@4", "pointer-written@1", "retire@1", "discard@1", "pointer-written@2", "retire@2"],
)
def test_killed_at_every_step_of_the_rotation_leaves_a_good_checkpoint(disk_dir, reference, point):
    """--save-interval 1 --keep-last 1 from the iteration-2 checkpoint: iterations 3 and 4
    each stage, publish, get verified, move the pointer and retire the one before. Killed
    at any of those steps, a complete checkpoint is on disk, and the resume ends
    bit-identical to the uninterrupted run."""
    expected, half = reference
    ckpt, root, metrics = copy_of(half, disk_dir)
    args = [
        "--iterations",
        "4",
        "--load",
        ckpt,
        "--resume",
        "auto",
        "--save",
        ckpt,
        "--save-interval",
        "1",
        "--keep-last",
        "1",
    ]
    killed = run(args, root=root, metrics=metrics, kill_at=point)
    assert killed.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), (killed.returncode, killed.stderr[-2000:])
    assert good_iterations(ckpt) or any(n.endswith(".new") for n in os.listdir(ckpt)), (
        f"no complete checkpoint left after a kill at {point}: {os.listdir(ckpt)}"
    )
    shutil.rmtree(root)
    resumed = run(args, root=root, metrics=metrics)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same(expected, state_of(ckpt))
    assert sorted(os.listdir(ckpt)) == ["iter_0000004", rotation.POINTER]
    assert open(os.path.join(ckpt, rotation.POINTER)).read() == "4\n"


@pytest.fixture
def small_fs(tmp_path):
    path = str(tmp_path / "small")
    os.makedirs(path)
    yield path
    subprocess.run(["umount", path], capture_output=True)


def test_a_save_that_cannot_fit_beside_the_previous_one_is_refused_at_the_save(disk_dir, reference, small_fs):
    """Room for one checkpoint and a half: the first save fits, the second is refused
    before it stages anything, saying how much it needs; the first stays whole."""
    ckpt, root = os.path.join(small_fs, "ckpt"), os.path.join(disk_dir, "offload")
    probe = os.path.join(disk_dir, "probe")
    done = run(["--iterations", "1", "--save", probe], root=root, metrics=os.path.join(disk_dir, "p.jsonl"))
    assert done.returncode == 0, done.stderr[-2000:]
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(probe) for f in fs)
    room = (size * 3 // 2 + 4095) // 4096 * 4096
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={room}", "tmpfs", small_fs], capture_output=True
    ).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    proc = run(
        ["--iterations", "2", "--save", ckpt, "--save-interval", "1"],
        root=root,
        metrics=os.path.join(disk_dir, "m.jsonl"),
    )
    assert "saved iteration 1" in proc.stdout, proc.stderr[-2000:]
    one_line(
        proc,
        rf"--save {re.escape(ckpt)}: this checkpoint needs \S+ \S+ beside the ones kept \(iter_0000001\), "
        r"only \S+ \S+ is free: free space, lower --keep-last, or choose another dir",
    )
    assert sorted(os.listdir(ckpt)) == ["iter_0000001", rotation.POINTER]
    again = run(["--iterations", "1", "--load", ckpt], root=root, metrics=os.path.join(disk_dir, "m3.jsonl"))
    assert again.returncode == 0, again.stderr[-2000:]
