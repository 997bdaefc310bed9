"""What comes after a fault: a failed wake, a failed sleep and a failed
optimizer step leave no silent state behind.

The actor cases run tests/faults/fault_worker.py under strace, which fails the third ``preadv2``
(wake) or ``pwrite64`` (sleep) of each I/O thread with EIO, exactly as a flaky disk would:
once, then the same calls work again. The optimizer case fails one write of bucket 3 at
the syscall wrapper of the I/O engine (the fault hook of tests/faults/fault_worker.py's kind),
so it turns into the same ``StorageError`` a disk's EIO does. Real files throughout.
"""

import contextlib
import os
import re

import pytest
import torch

from greenroom.errors import GreenroomError, StorageError
from greenroom.optim import StreamingAdam, StreamingMuon
from greenroom.optim.checkpoint import reflink
from greenroom.optim.checkpoint import save_load as checkpoint
from tests.conftest import require_tool
from tests.faults.test_faults import run_worker

EIO_LINE = (
    r"\S+/actor\.state: (read|write) of \d+ bytes at offset \d+ of the actor's offload file failed: "
    r"Input/output error \(EIO\); .*"
)


def _under_strace(syscall: str, *args: str):
    strace = require_tool("strace")
    inject = ["-f", "-qq", "-o", "/dev/null", "-e", f"trace={syscall}", "-e", f"inject={syscall}:error=EIO:when=3"]
    proc = run_worker(*args, prefix=[strace, *inject])
    assert proc.returncode == 0, proc.stderr
    return dict(line.split(": ", 1) for line in proc.stdout.strip().splitlines())


def test_a_wake_whose_read_fails_raises_stays_asleep_and_the_retry_is_bit_identical(disk_dir):
    """A transfer that fails before the wake's last read is submitted is not dropped
    unseen: wake() raises, the actor stays asleep, and the retry is bit-identical."""
    said = _under_strace("preadv2", "wake-retry", disk_dir, "none")
    assert re.fullmatch("raised: " + EIO_LINE, said["first"]), said["first"]
    assert said["asleep"] == "True"
    assert said["files"] == "['actor.state']"
    assert said["identical after the retry"] == "True"


def test_a_sleep_whose_write_fails_is_undone_and_a_wake_is_refused_in_one_line(disk_dir):
    """The device copy is given back only after every byte is written,
    so a failed sleep leaves the actor awake and unchanged; wake() then has nothing to
    hand back and says so, and the next sleep/wake round trip is bit-identical."""
    said = _under_strace("pwrite64", "sleep-retry", disk_dir, "none")
    assert re.fullmatch("raised: " + EIO_LINE, said["first"]), said["first"]
    assert said["asleep"] == "False"
    assert said["awake and unchanged"] == "True"
    assert re.fullmatch(
        r"raised: actor offload: wake\(\) after a failed sleep: nothing to wake, the sleep was "
        r"undone and every tensor is still on the device as it was \(the sleep failed with: " + EIO_LINE + r"\)",
        said["wake"],
    ), said["wake"]
    assert said["identical after the retry"] == "True"


# -- a failed optimizer step --------------------------------------------------------------
def _optimizer(directory, kind):
    """Five bf16 matrices (Muon takes 2-D params only), a bucket each."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(100, 1000, dtype=torch.bfloat16)) for _ in range(5)]
    extra = {"resident_numel": 0} if kind is StreamingAdam else {}
    opt = kind(params, lr=1e-2, state_dir=directory, bucket_numel=100_000, chunk_mb=1, **extra)
    return params, opt


def _grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


@contextlib.contextmanager
def _twins(disk_dir, kind):
    """(params, optimizer) that will see a fault, and a twin that never does."""
    faulty, twin = (_optimizer(os.path.join(disk_dir, name), kind) for name in ("faulty", "twin"))
    try:
        yield faulty, twin
    finally:
        faulty[1].close()
        twin[1].close()


def _step(pairs, *seeds):
    """A step of each (params, optimizer) per seed, on the same grads."""
    for seed in seeds:
        for params, opt in pairs:
            _grads(params, seed)
            opt.step()


def _assert_same_params(pairs):
    (ours, _), (theirs, _) = pairs
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", [StreamingAdam, StreamingMuon], ids=lambda k: k.__name__)
def test_after_a_failed_step_the_optimizer_refuses_until_a_checkpoint_is_loaded(disk_dir, fail_a_write_of, kind):
    """Bucket 3's write-back fails in step 2. Nothing trains on from the half-updated
    state: every later step(), state_dict() and save_checkpoint() names the first failure,
    and a checkpoint load makes the run bit-identical again to a twin that never saw the
    fault. StreamingMuon goes through the same code (``greenroom.optim.streamed``)."""
    with _twins(disk_dir, kind) as pairs:
        (params, opt), (twin_params, twin) = pairs
        _step(pairs, 1)
        ckpt = os.path.join(disk_dir, "ckpt")
        opt.save_checkpoint(ckpt)
        weights_at_1 = [p.detach().clone() for p in params]

        _grads(params, 2)
        # Saved by links (one filesystem), the live file is shared: the step writes bucket
        # 3 to a new inode beside it (optim.store.files Note [new inodes]); that write fails.
        shared = opt.store.shared(3)
        fail_a_write_of(opt.store.path(3) + (".new" if shared else ""))
        name = r"bucket-00003\.bin\.new" if shared else r"bucket-00003\.bin"
        with pytest.raises(
            StorageError,
            match=name + r": write of \d+ bytes at offset \d+ of bucket 3 "
            r"of the optimizer state failed: Input/output error \(EIO\)",
        ):
            opt.step()
        first = (
            r"\(StorageError: \S+/" + name + r": write of \d+ bytes at offset \d+ of bucket 3 of the "
            r"optimizer state failed: Input/output error \(EIO\); .*\) and left the state partly updated"
        )
        for what, call in (
            ("step()", opt.step),
            ("state_dict()", opt.state_dict),
            ("save_checkpoint()", lambda: opt.save_checkpoint(ckpt)),
        ):
            with pytest.raises(GreenroomError) as err:
                call()
            assert "\n" not in str(err.value)
            assert re.match(
                rf"{kind.__name__}: {re.escape(what)} refused: an earlier step\(\) failed {first}", str(err.value)
            ), str(err.value)

        opt.load_checkpoint(ckpt)
        with torch.no_grad():
            for p, w in zip(params, weights_at_1):
                p.copy_(w)
        _step(pairs, 2, 3)
        _assert_same_params(pairs)
        ours, theirs = opt.state_dict()["state"], twin.state_dict()["state"]
        for key in theirs:
            for name in theirs[key]:
                assert torch.equal(ours[key][name], theirs[key][name]), (key, name)


def test_a_load_that_fails_after_replacing_a_bucket_refuses_until_a_load_succeeds(disk_dir, monkeypatch):
    """A load that fails part way (the copy of bucket 2 fails with EIO, after buckets 0 and 1
    hold the checkpoint's bytes) leaves an optimizer that refuses like a failed step rather
    than step on from the mix, and a load that completes makes it
    bit-identical to a twin that never saw the fault. The copy stands in for a checkpoint
    on another filesystem (links and clones turned off): this machine has one."""
    with _twins(disk_dir, StreamingAdam) as pairs:
        (params, opt), (_, twin) = pairs
        _step(pairs, 0)
        ckpt = os.path.join(disk_dir, "ckpt")
        opt.save_checkpoint(ckpt)
        _step(pairs, 1)
        monkeypatch.setattr(checkpoint, "links_work", lambda *a: False)
        monkeypatch.setattr(reflink, "usable", lambda *a: False)
        real, victim = checkpoint.copy_file, opt.store.path(2)

        def copy_file(src, dst, size, **kwargs):
            if dst.startswith(victim):
                raise StorageError(f"copying {src} to {dst} failed: Input/output error")
            return real(src, dst, size, **kwargs)

        monkeypatch.setattr(checkpoint, "copy_file", copy_file)
        with pytest.raises(StorageError, match=r"bucket-00002\.bin\S* failed: Input/output error"):
            opt.load_checkpoint(ckpt)
        _grads(params, 2)
        with pytest.raises(GreenroomError) as err:
            opt.step()
        assert "\n" not in str(err.value)
        assert re.match(
            r"StreamingAdam: step\(\) refused: an earlier load_checkpoint\(\) failed \(StorageError: "
            r".*\) and left the state partly loaded",
            str(err.value),
        ), str(err.value)
        monkeypatch.setattr(checkpoint, "copy_file", real)
        for _, o in pairs:
            o.load_checkpoint(ckpt)
        _step(pairs, 2)
        _assert_same_params(pairs)


@pytest.mark.parametrize("kind", [StreamingAdam, StreamingMuon], ids=lambda k: k.__name__)
def test_a_state_dict_load_whose_bucket_write_fails_refuses_until_a_load_succeeds(disk_dir, fail_a_write_of, kind):
    """load_state_dict verifies the whole dict, then writes bucket by bucket: a write that
    fails there (bucket 2, EIO) leaves some buckets loaded and some not, and the optimizer
    refuses like a failed step until a load completes."""
    with _twins(disk_dir, kind) as pairs:
        (params, opt), (twin_params, twin) = pairs
        _step(pairs, 0)
        _step(pairs[1:], 1)
        saved = twin.state_dict()
        fail_a_write_of(opt.store.path(2))
        with pytest.raises(StorageError, match=r"bucket-00002\.bin: write of \d+ bytes"):
            opt.load_state_dict(saved)
        with pytest.raises(GreenroomError) as err:
            opt.state_dict()
        assert re.match(
            rf"{kind.__name__}: state_dict\(\) refused: an earlier load_state_dict\(\) failed "
            r"\(StorageError: .*\) and left the state partly loaded",
            str(err.value),
        ), str(err.value)
        opt.load_state_dict(saved)
        with torch.no_grad():
            for p, q in zip(params, twin_params):
                p.copy_(q)
        _step(pairs, 2)
        _assert_same_params(pairs)


@pytest.mark.parametrize("kind", [StreamingAdam, StreamingMuon], ids=lambda k: k.__name__)
def test_a_fresh_state_whose_bucket_write_fails_refuses_until_a_load_succeeds(disk_dir, fail_a_write_of, kind):
    """``load_checkpoint(no_load_optim=True)`` (``initialize_state``) whose write of bucket 2
    fails: buckets 0-1 were fresh, the rest kept their moments, the step counters all
    restarted, and the next step ran on the mix without a word."""
    with _twins(disk_dir, kind) as pairs:
        (params, opt), (twin_params, twin) = pairs
        _step(pairs, 0, 1)
        fail_a_write_of(opt.store.path(2))
        with pytest.raises(StorageError, match=r"bucket-00002\.bin: write of \d+ bytes"):
            opt.load_checkpoint(os.path.join(disk_dir, "unused"), no_load_optim=True)
        with pytest.raises(GreenroomError) as err:
            opt.step()
        assert re.match(
            rf"{kind.__name__}: step\(\) refused: an earlier initialize_state\(\) failed \(StorageError: "
            r".*\) and left the state partly reset",
            str(err.value),
        ), str(err.value)
        for _, o in pairs:
            o.initialize_state()
        with torch.no_grad():
            for p, q in zip(params, twin_params):
                p.copy_(q)
        _step(pairs, 2)
        _assert_same_params(pairs)
