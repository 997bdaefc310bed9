"""``greenroom train --save/--load`` after and around faults: a save that
verifies what it copies, one writer per checkpoint dir, a symlinked ``--load``, and
resume flags that would change a checkpoint's meaning.

Races are made deterministic with ``GREENROOM_TEST_STOP_AT`` (``greenroom.faults``): the
trainer SIGSTOPs itself at a named point, the test acts (flips a byte of a live file,
starts a second trainer), then SIGCONTs it. Real processes and files throughout.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile

import pytest

from tests.cli_support import greenroom_stopped_at
from tests.train.test_faults import FLAGS, assert_same, newest, reference, run, state_of  # noqa: F401 (a fixture)
from tests.train.test_loop import env

JOB = "ckpt-faults"


def start(args, *, root, metrics, stop_at):
    """A trainer (job ``JOB``) that stops itself at ``stop_at``; returns once it has."""
    return greenroom_stopped_at(
        stop_at,
        "train",
        *FLAGS,
        "--offload-train-disk-dir",
        root,
        "--metrics",
        metrics,
        *args,
        env={**env(), "GREENROOM_JOB_ID": JOB},
    )


def resume(proc):
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def one_line(proc, pattern):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    [line] = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert re.search(pattern, line), line
    return line


def copy_of(half, disk_dir):
    ckpt = os.path.join(disk_dir, "ckpt")
    shutil.copytree(half, ckpt)
    return ckpt, os.path.join(disk_dir, "offload"), os.path.join(disk_dir, "m.jsonl")


def test_a_byte_flipped_in_a_live_bucket_before_the_saving_step_is_refused_and_the_previous_checkpoint_kept(
    disk_dir, reference
):
    """A save must not copy the flipped bucket, report "saved iteration 4" and replace the
    good checkpoint with one no resume accepts. The trainer's save comes from the last
    step's own pass (``optim.checkpoint.instep``), whose reads are verified: a
    flip before that step stops it, and nothing is published. The flip goes in after
    iteration 4's sleep wrote the bucket back: between two steps its one bucket stays on
    the device (``optim.store.held`` Note [the last bucket stays]), and a flip in its file
    then is overwritten unread."""
    _, half = reference
    ckpt, root, metrics = copy_of(half, disk_dir)
    # Iteration 4's rollout (the resumed run's second): after its sleep, before its steps.
    proc = start(["--iterations", "4", "--load", ckpt, "--save", ckpt], root=root, metrics=metrics, stop_at="rollout@2")
    live = os.path.join(root, JOB, "actor", "rank00000", "optim", "bucket-00000.bin")
    with open(live, "r+b") as f:
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0x04]))
    failed = resume(proc)
    one_line(
        failed,
        r"bucket-00000\.bin: checksum mismatch at offset 0 \(bytes \[0, \d+\) of bucket 0 of the "
        r"optimizer state\): what was read back is not what greenroom wrote",
    )
    assert "saved iteration" not in failed.stdout
    assert_same(state_of(half), state_of(ckpt))
    resumed = run(["--iterations", "3", "--load", ckpt], root=root, metrics=metrics)
    assert resumed.returncode == 0 and "resuming at iteration 3" in resumed.stdout, resumed.stderr[-2000:]
    assert sorted(os.listdir(disk_dir)) == ["ckpt", "m.jsonl", "offload"], "a leftover beside the checkpoint"


def test_a_copying_save_checks_every_byte_against_the_live_checksums(disk_dir):
    """The copy path of ``save_checkpoint`` (between steps, where the
    filesystem cannot clone): a flipped live byte is refused before anything is published,
    and the previous checkpoint stays byte for byte."""
    import torch

    from greenroom.errors import IntegrityError
    from greenroom.optim import StreamingAdam
    from greenroom.optim.checkpoint import reflink

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(100_000, dtype=torch.bfloat16)) for _ in range(2)]
    opt = StreamingAdam(
        params, state_dir=os.path.join(disk_dir, "live"), bucket_numel=100_000, chunk_mb=1, resident_numel=0
    )
    # The checkpoint on another filesystem than the live files: a copy, never a clone.
    elsewhere = tempfile.mkdtemp(prefix="greenroom-ckpt-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        if reflink.usable(opt.store.directory, elsewhere, opt.store.state_bytes):
            pytest.skip("no second filesystem here: the save would link or clone the files and read nothing")
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        ckpt = os.path.join(elsewhere, "ckpt")
        opt.save_checkpoint(ckpt)
        before = {n: open(os.path.join(ckpt, n), "rb").read() for n in os.listdir(ckpt)}
        opt.step()
        # Bucket 1 stays on the device after the step, and the save writes it out first
        # (optim.store.held Note [the last bucket stays]): the flip goes in bucket 0.
        assert opt.store.held.kept.index == 1
        with open(opt.store.path(0), "r+b") as f:
            f.seek(4096 * 3 + 1)
            byte = f.read(1)
            f.seek(4096 * 3 + 1)
            f.write(bytes([byte[0] ^ 0x80]))
        with pytest.raises(
            IntegrityError,
            match=r"bucket-00000\.bin: checksum mismatch at offset 0 .* while saving a "
            r"checkpoint: .*nothing was published, the previous checkpoint stays",
        ):
            opt.save_checkpoint(ckpt)
        assert {n: open(os.path.join(ckpt, n), "rb").read() for n in os.listdir(ckpt)} == before
        assert os.listdir(elsewhere) == ["ckpt"]
    finally:
        opt.close()
        shutil.rmtree(elsewhere)


def test_a_second_trainer_saving_to_the_same_dir_is_refused_in_one_line_before_it_trains(disk_dir, reference):
    """Two trainers with one --save must not both print "saved iteration 3" while the dir
    holds one of them: the second is refused. A run that only loads it is refused too (it
    could read a checkpoint the first run's save is swapping out)."""
    _, half = reference
    ckpt, root, metrics = copy_of(half, disk_dir)
    first = start(
        ["--iterations", "3", "--load", ckpt, "--save", ckpt], root=root, metrics=metrics, stop_at="train-step"
    )
    try:
        second = run(
            ["--iterations", "3", "--save", ckpt, "--seed", "1"],
            root=root,
            metrics=os.path.join(disk_dir, "second.jsonl"),
        )
        one_line(
            second,
            rf"{re.escape(ckpt)}: another process \(pid {first.pid} on \S+\) holds "
            rf"{re.escape(ckpt)}\.lock: it is saving there .*give this run another checkpoint dir",
        )
        assert "iter" not in second.stdout, "refused before training"
        reader = run(["--iterations", "3", "--load", ckpt], root=root, metrics=os.path.join(disk_dir, "third.jsonl"))
        one_line(
            reader,
            rf"{re.escape(ckpt)}: another process \(pid {first.pid} on \S+\) holds "
            rf"{re.escape(ckpt)}\.lock: it saves there, and a load now could read a checkpoint it "
            r"is replacing",
        )
    finally:
        done = resume(first)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "saved iteration 3" in done.stdout
    assert state_of(ckpt)["iteration"].item() == 3
    assert sorted(os.listdir(disk_dir)) == ["ckpt", "m.jsonl", "offload"], "the lock file stays behind"


def test_a_symlinked_load_finishes_a_killed_save_like_the_real_path(disk_dir, reference):
    """Through a symlink the complete DIR.new beside the target is found, and the resume
    starts from it, not silently from the older checkpoint."""
    _, half = reference
    ckpt, root, metrics = copy_of(half, disk_dir)
    killed = run(
        ["--iterations", "3", "--load", ckpt, "--save", ckpt], root=root, metrics=metrics, kill_at="save-staged@2"
    )
    assert killed.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL), killed.stderr[-2000:]
    shutil.rmtree(root)
    link = os.path.join(disk_dir, "link")
    os.symlink(ckpt, link)
    resumed = run(["--iterations", "4", "--load", link], root=root, metrics=metrics)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "complete but not yet moved into place" in resumed.stderr
    assert "resuming at iteration 4" in resumed.stdout
    assert sorted(os.listdir(disk_dir)) == ["ckpt", "link", "m.jsonl", "offload"]


# -- resume flags that would change what the checkpoint means ---------------------------
def test_iterations_below_the_checkpoints_is_refused_in_one_line_and_nothing_is_saved(disk_dir, reference):
    """Not an exit 0 with "saved iteration 1" over iteration-2 weights."""
    _, half = reference
    ckpt, root, metrics = copy_of(half, disk_dir)
    before = state_of(ckpt)
    proc = run(["--iterations", "1", "--load", ckpt, "--save", ckpt], root=root, metrics=metrics)
    one_line(
        proc,
        rf"--iterations 1 is below the iteration of --load {re.escape(ckpt)} \(2\): a resumed run trains "
        r"up to --iterations in all, so give --iterations 2 or more",
    )
    assert_same(before, state_of(ckpt))
    assert sorted(os.listdir(disk_dir)) == ["ckpt", "offload"]


def test_lr_on_resume_is_applied_and_said(disk_dir, reference):
    """Not ignored without a word (the groups come from the checkpoint otherwise)."""
    _, half = reference
    ckpt, root, metrics = copy_of(half, disk_dir)
    proc = run(["--iterations", "3", "--load", ckpt, "--save", ckpt, "--lr", "0.01"], root=root, metrics=metrics)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"--lr 0.01: replaces the lr 0.003 that {ckpt} was saved with" in proc.stderr
    manifest = json.load(open(os.path.join(newest(ckpt), "rank00000", "optim", "manifest.json")))
    assert [g["lr"] for g in manifest["param_groups"]] == [0.01]
    same = run(["--iterations", "3", "--load", half], root=root, metrics=metrics)
    assert same.returncode == 0 and "replaces" not in same.stderr, same.stderr[-2000:]


def test_a_dtype_other_than_the_checkpoints_is_refused_in_one_line(disk_dir, reference):
    """A bf16 checkpoint resumed with --dtype fp32 is refused, not cast without a word."""
    _, half = reference
    ckpt, root, metrics = copy_of(half, disk_dir)
    proc = run(["--iterations", "3", "--load", ckpt, "--dtype", "fp32"], root=root, metrics=metrics)
    one_line(
        proc,
        r"the weights were saved as bf16 \(--dtype bf16\), this run has --dtype fp32: resume with "
        r"--dtype bf16",
    )


def test_a_model_of_other_sizes_is_refused_in_one_line(disk_dir, reference):
    """--n-heads 2 instead of 4 leaves every tensor its shape (the heads split the same
    weights another way), and must not resume without a word; the meta records the sizes."""
    _, half = reference
    ckpt, root, metrics = copy_of(half, disk_dir)
    proc = run(["--iterations", "3", "--load", ckpt, "--n-heads", "2"], root=root, metrics=metrics)
    one_line(proc, r"saved from another model: --n-heads 4 \(this run 2\); resume with the sizes it was saved with")


def test_weights_this_model_lacks_are_refused_where_the_meta_predates_the_sizes(disk_dir, reference):
    """A checkpoint whose meta has no sizes (written before they were recorded) of a
    2-block model, resumed with --n-layers 1: block 1's weights are not dropped silently."""
    from greenroom.io import publish
    from greenroom.train.checkpoint import META

    _, half = reference
    ckpt, root, metrics = copy_of(half, disk_dir)
    meta = json.load(open(os.path.join(newest(ckpt), META)))
    assert meta.pop("model")["n_layers"] == 2
    publish.write_checked_json(os.path.join(newest(ckpt), META), {k: v for k, v in meta.items() if k != "crc32"})
    proc = run(["--iterations", "3", "--load", ckpt, "--n-layers", "1", "--no-load-optim"], root=root, metrics=metrics)
    one_line(proc, r"model\.pt: holds \S*1\.\S+ and \d+ more, which this model does not have")


# -- the metrics of a killed and resumed run -------------------------------------------------
def test_a_killed_and_resumed_run_logs_each_iteration_once(disk_dir, reference):
    """The killed run logged iteration 3 after the checkpoint at 2; the resume trains it
    again, and its record sits once in the file (twice, ``report`` would plot both)."""
    from tests.train.test_faults import kill_and_resume

    resumed = kill_and_resume(disk_dir, reference, "sleep@2")
    assert "dropped 1 record(s) of iterations past the checkpoint's 2 (3-3" in resumed.stderr
    records = [json.loads(line) for line in open(os.path.join(disk_dir, "m.jsonl"))]
    assert [r["iteration"] for r in records] == [3, 4]


def test_an_async_save_whose_other_rank_fails_stops_rank_0_with_its_reason(disk_dir):
    """``--async-save`` on two ranks: rank 0 waits for the other's manifest file with no
    collective; were rank 1's failure silent it would wait forever (its thread, and the
    run at its next save or exit). Rank 1 leaves its reason, and rank 0 raises it;
    nothing is published. Both ranks run here in one process, as the two threads of the
    save would on two hosts: the protocol is files in the checkpoint dir."""
    import threading

    import torch

    from greenroom.errors import CheckpointError
    from greenroom.train import checkpoint

    ckpt = os.path.join(disk_dir, "ckpt")
    for rank in (0, 1):
        checkpoint.begin(ckpt, rank=rank, barrier=lambda: None)
    common = dict(
        model_config=None,
        optimizer=None,
        optim_state={},
        streaming=False,
        optim_written=False,
        iteration=1,
        world_size=2,
    )
    with pytest.raises(Exception):  # a weight torch.save cannot write: rank 1's part fails
        checkpoint.finish(ckpt, model_state={"w": lambda: None}, rank=1, **common)
    raised = []

    def rank0():
        try:
            checkpoint.finish(ckpt, model_state={"w": torch.zeros(2)}, rank=0, **common)
        except BaseException as e:
            raised.append(e)

    thread = threading.Thread(target=rank0, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "rank 0 still waits for rank 1's part"
    [error] = raised
    assert isinstance(error, CheckpointError) and "rank 1's part of the save failed" in str(error)
    assert not os.path.exists(ckpt) and not os.path.exists(ckpt + ".new")
