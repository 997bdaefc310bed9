"""StreamingAdam checkpoints: a round trip stays bit-exact; every mismatch is refused by name."""

import json
import logging
import os
import shutil

import pytest
import torch

from greenroom.errors import CheckpointError
from greenroom.optim import StreamingAdam
from greenroom.optim.checkpoint import save_load as ckpt
from greenroom.optim.checkpoint.manifest import MANIFEST
from tests.optim.support import ODD_SHAPES, assert_state_equal, set_grads, twins

SHAPES = ODD_SHAPES + [(100,)]  # the last one stays resident (tiny fp32)


def _optimizer(params, directory, **kwargs):
    groups = [{"params": params[:4]}, {"params": params[4:], "lr": 2e-3, "weight_decay": 0.05}]
    kwargs = {"lr": 1e-2, "weight_decay": 0.01, "bucket_numel": 2000, "resident_numel": 100, **kwargs}
    return StreamingAdam(groups, state_dir=directory, **kwargs)


def _train(opt, params, steps, start=0, ref=None, ref_params=None):
    for step in range(start, start + steps):
        set_grads(params, *([ref_params] if ref is not None else []), step=step, skip={2} if step == 1 else ())
        opt.step()
        if ref is not None:
            ref.step()


@pytest.fixture
def saved(disk_dir):
    """An optimizer trained 3 steps and saved to ``<disk_dir>/ckpt``; its params."""
    params, _ = twins(SHAPES)
    opt = _optimizer(params, os.path.join(disk_dir, "live"))
    _train(opt, params, 3)
    path = os.path.join(disk_dir, "ckpt")
    opt.save_checkpoint(path)
    yield opt, params, path
    opt.close()


def test_round_trip_in_the_middle_stays_bit_exact(disk_dir):
    ours, ref_params = twins(SHAPES)
    opt = _optimizer(ours, os.path.join(disk_dir, "a"))
    ref = torch.optim.AdamW(
        [{"params": ref_params[:4]}, {"params": ref_params[4:], "lr": 2e-3, "weight_decay": 0.05}],
        lr=1e-2,
        weight_decay=0.01,
        foreach=True,
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
    for step in range(3):
        _train(opt, ours, 1, start=step, ref=ref, ref_params=ref_params)
        sched.step()
        ref_sched.step()
    path = os.path.join(disk_dir, "ckpt")
    opt.save_checkpoint(path)
    manifest = json.load(open(os.path.join(path, MANIFEST)))
    assert manifest["moment_dtype"] == "fp32" and manifest["master_dtype"] == "fp32"
    assert manifest["topology"] == {"world_size": 1, "rank": 0, "shards": {}}
    assert set(manifest["files"]) == {f"bucket-{i:05d}.bin" for i in range(len(opt.store.buckets))} | {"resident.pt"}
    assert manifest["steps"]["0.0"] == 3.0 and manifest["steps"]["0.2"] == 2.0
    saved_params = [p.detach().clone() for p in ours]
    sched_state = sched.state_dict()
    opt.close()

    # a new process's optimizer: fresh params object, fresh files, state from the checkpoint
    resumed = [torch.nn.Parameter(p.clone()) for p in saved_params]
    opt2 = _optimizer(resumed, os.path.join(disk_dir, "b"))
    opt2.load_checkpoint(path)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    sched2.load_state_dict(sched_state)
    assert opt2.param_groups[1]["lr"] == ref.param_groups[1]["lr"]
    assert_state_equal(opt2, ref, resumed, ref_params)
    for step in range(3, 6):
        _train(opt2, resumed, 1, start=step, ref=ref, ref_params=ref_params)
        sched2.step()
        ref_sched.step()
    assert_state_equal(opt2, ref, resumed, ref_params)
    opt2.close()


def test_saving_again_replaces_the_checkpoint_atomically(saved):
    opt, params, path = saved
    _train(opt, params, 1, start=3)
    opt.save_checkpoint(path)
    assert json.load(open(os.path.join(path, MANIFEST)))["steps"]["0.0"] == 4.0
    assert [n for n in os.listdir(os.path.dirname(path)) if n.startswith("ckpt")] == ["ckpt"]


def test_interrupted_save_leaves_the_previous_checkpoint_intact(saved, monkeypatch):
    opt, params, path = saved
    before = {n: open(os.path.join(path, n), "rb").read() for n in os.listdir(path)}
    _train(opt, params, 1, start=3)
    calls = []
    real_link = ckpt.link_new  # the checkpoint beside the state: the bucket files are linked

    def link_then_fail(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a ^C half way through the bucket files
        return real_link(src, dst)

    monkeypatch.setattr(ckpt, "link_new", link_then_fail)
    with pytest.raises(KeyboardInterrupt):
        opt.save_checkpoint(path)
    monkeypatch.undo()
    assert {n: open(os.path.join(path, n), "rb").read() for n in os.listdir(path)} == before
    assert [n for n in os.listdir(os.path.dirname(path)) if n.startswith("ckpt")] == ["ckpt"]
    fresh = _optimizer(
        [torch.nn.Parameter(p.detach().clone()) for p in params], os.path.join(os.path.dirname(path), "other")
    )
    fresh.load_checkpoint(path)  # still verifies and loads
    assert float(fresh.state[fresh.streamed[0]]["step"]) == 3.0
    fresh.close()


def _load_into(path, params, directory, **kwargs):
    opt = _optimizer([torch.nn.Parameter(p.detach().clone()) for p in params], directory, **kwargs)
    try:
        opt.load_checkpoint(path)
    finally:
        opt.close()


def test_refuses_other_moment_dtype(saved, disk_dir):
    _, params, path = saved
    with pytest.raises(
        CheckpointError, match="moment dtype fp32, this run uses bf16.*--stream-optimizer-state-moment-dtype fp32"
    ):
        _load_into(path, params, os.path.join(disk_dir, "x"), moment_dtype="bf16")


def test_refuses_other_layout(saved, disk_dir):
    _, params, path = saved
    with pytest.raises(
        CheckpointError, match="bucket_numel 2000, this run has 3000; build the optimizer with bucket_numel=2000"
    ):
        _load_into(path, params, os.path.join(disk_dir, "x"), bucket_numel=3000)
    other = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES[:-2] + [(9, 999), (100,)]]
    with pytest.raises(CheckpointError, match="layout differs at param 1.2"):
        _load_into(path, other, os.path.join(disk_dir, "y"))


def test_refuses_a_resident_state_that_does_not_fit_before_touching_the_state(saved, disk_dir):
    """The small fp32 params' state (resident.pt) is checked with the layout: a resident
    param of another shape, or one this model lacks, is refused in one line before any
    bucket is replaced, and the optimizer steps on from its own state."""
    opt, params, path = saved
    live_before = streamed_bytes(opt)
    other = [torch.nn.Parameter(p.detach().clone()) for p in params[:-1]] + [torch.nn.Parameter(torch.zeros(99))]
    with pytest.raises(
        CheckpointError,
        match=r"resident\.pt: param 1\.\d+'s exp_avg is torch\.float32 \(100,\), "
        r"the param here is torch\.float32 \(99,\): resume with the model",
    ):
        _load_into(path, other, os.path.join(disk_dir, "x"))
    with pytest.raises(
        CheckpointError,
        match=r"resident\.pt: holds state for param 1\.\d+, which this optimizer "
        "does not have",
    ):
        _load_into(path, params[:-1], os.path.join(disk_dir, "y"))
    fewer = _optimizer([torch.nn.Parameter(p.detach().clone()) for p in params[:-1]], os.path.join(disk_dir, "z"))
    try:
        with pytest.raises(CheckpointError, match="which this optimizer does not have"):
            fewer.load_checkpoint(path)
        set_grads(fewer.param_groups[0]["params"] + fewer.param_groups[1]["params"], step=0)
        fewer.step()  # refused before anything changed: not poisoned
    finally:
        fewer.close()
    assert streamed_bytes(opt) == live_before


def test_refuses_other_topology(saved, disk_dir):
    _, params, path = saved
    manifest_path = os.path.join(path, MANIFEST)
    manifest = json.load(open(manifest_path))
    manifest["topology"]["world_size"] = 4  # as if rank 0 of a 4-rank run wrote it
    json.dump(manifest, open(manifest_path, "w"))
    with pytest.raises(CheckpointError, match="world size 4, this run has 1; resume is same-topology only"):
        _load_into(path, params, os.path.join(disk_dir, "x"))


def test_refuses_a_corrupt_or_truncated_file_before_touching_the_state(saved, disk_dir):
    opt, params, path = saved
    victim = os.path.join(path, "bucket-00001.bin")
    # The save linked the live file (one filesystem): damage the checkpoint's own copy
    # of it, as a bad disk under the checkpoint dir would, not the live file too.
    shutil.copyfile(victim, victim + ".copy")
    os.replace(victim + ".copy", victim)
    with open(victim, "r+b") as f:
        f.seek(4097)
        byte = f.read(1)
        f.seek(4097)
        f.write(bytes([byte[0] ^ 0x40]))
    live_before = streamed_bytes(opt)
    with pytest.raises(CheckpointError, match=r"bucket-00001\.bin: checksum mismatch in extent 0 "):
        opt.load_checkpoint(path)
    assert streamed_bytes(opt) == live_before  # verified before reading a byte of state
    os.truncate(victim, 4096)
    with pytest.raises(CheckpointError, match="4096 bytes, the manifest says"):
        opt.load_checkpoint(path)


def streamed_bytes(opt):
    return [open(opt.store.path(b.index), "rb").read() for b in opt.store.buckets]


def test_refuses_a_checkpoint_without_streamed_state_unless_no_load_optim(disk_dir, caplog):
    params, _ = twins(SHAPES)
    resident = torch.optim.AdamW(params)
    old = os.path.join(disk_dir, "before-streaming")
    os.makedirs(old)
    torch.save(resident.state_dict(), os.path.join(old, "optim.pt"))  # what a resident run leaves
    opt = _optimizer(params, os.path.join(disk_dir, "live"))
    _train(opt, params, 2)
    with pytest.raises(CheckpointError, match="no streamed optimizer state.*no_load_optim=True"):
        opt.load_checkpoint(old)
    with pytest.raises(CheckpointError, match="no streamed optimizer state"):
        opt.load_checkpoint(os.path.join(disk_dir, "does-not-exist"))
    with caplog.at_level(logging.WARNING, logger="greenroom"):
        opt.load_checkpoint(old, no_load_optim=True)
    assert [r.levelname for r in caplog.records if "fresh optimizer state" in r.getMessage()] == ["WARNING"]
    assert not opt.state  # step 0 everywhere
    for state in opt.store.stream():
        assert not state.exp_avg.any() and not state.exp_avg_sq.any()
    opt.close()


def test_checkpoint_of_bf16_moments_round_trips_bytes(disk_dir):
    params, _ = twins(SHAPES, dtype=torch.bfloat16)
    opt = _optimizer(params, os.path.join(disk_dir, "a"), moment_dtype="bf16")
    _train(opt, params, 2)
    path = os.path.join(disk_dir, "ckpt")
    opt.save_checkpoint(path)
    opt2 = _optimizer(
        [torch.nn.Parameter(p.detach().clone()) for p in params], os.path.join(disk_dir, "b"), moment_dtype="bf16"
    )
    opt2.load_checkpoint(path)
    assert streamed_bytes(opt2) == streamed_bytes(opt)
    with pytest.raises(CheckpointError, match="moment dtype bf16, this run uses fp32"):
        _load_into(path, params, os.path.join(disk_dir, "c"))
    opt.close()
    opt2.close()
