"""The last bucket a step updates stays on the device until something needs its file
(``optim.store.held`` Note [the last bucket stays]).

Back-to-back steps skip its read and its write-back and stay bit-identical to AdamW;
whatever reads the files, reuses the buffers or replaces the state first writes it
back (or, for a load, drops it); a failed write-back keeps it; a store dropped unclosed
writes nothing from the garbage collector.
"""

import copy
import gc
import os

import pytest
import torch

from greenroom.dirs.rankdir import RankDir
from greenroom.errors import StorageError
from greenroom.io import statefile
from greenroom.optim import StreamingAdam
from tests.optim.support import ODD_SHAPES, assert_state_equal, set_grads, twins

BUCKET_NUMEL = 1500  # ODD_SHAPES make 4 buckets of 24, 84, 12 and 60 KiB of fp32 state
# On CUDA the kept bucket's write-back goes through the engine after the step's encode on
# the caller's stream; the reference there is fused AdamW, as StreamingAdam's default is.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _device(name):
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA (runs on the GPU machine)")
    return name


def _opt(params, state_dir, **kwargs):
    return StreamingAdam(
        params, state_dir=state_dir, lr=1e-2, weight_decay=0.01, bucket_numel=BUCKET_NUMEL, resident_numel=0, **kwargs
    )


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, fused=params[0].is_cuda or None)


def _file_bytes(opt, index):
    with open(opt.store.path(index), "rb") as f:
        return f.read()


@pytest.mark.parametrize("device", DEVICES)
def test_back_to_back_steps_skip_the_kept_buckets_read_and_write_and_stay_bit_identical(disk_dir, device):
    ours, ref_params = twins(ODD_SHAPES, device=_device(device))
    opt = _opt(ours, disk_dir)
    ref = _adamw(ref_params)
    store = opt.store
    sizes = sorted(b.file_bytes for b in store.buckets)
    kept_before = 0
    for step in range(6):
        set_grads(ours, ref_params, step=step)
        read, written = store.bytes_read, store.bytes_written
        opt.step()
        ref.step()
        # The largest bucket is kept, then the largest of the rest: the two largest take turns.
        assert store.kept_bytes == sizes[-1 - step % 2]
        assert store.bytes_read - read == store.state_bytes - kept_before
        assert store.bytes_written - written == store.state_bytes - store.kept_bytes
        kept_before = store.kept_bytes
        if step == 3:  # what the offloader does before the actor sleeps: the next step reads every bucket
            opt.release_device_memory()
            assert store.kept_bytes == 0 and store.device_bytes() == 0
            kept_before = 0
    assert_state_equal(opt, ref, ours, ref_params)  # streams the state: the kept bucket comes first, unread
    opt.close()


@pytest.mark.parametrize("device", DEVICES)
def test_everything_that_reads_the_files_gets_the_kept_buckets_newest_bytes(disk_dir, device):
    ours, twin = twins(ODD_SHAPES, device=_device(device))
    opt, other = _opt(ours, os.path.join(disk_dir, "a")), _opt(twin, os.path.join(disk_dir, "b"))
    for step in range(2):
        set_grads(ours, twin, step=step)
        opt.step()
        other.step()
    kept = opt.store.held.kept.index
    stale = _file_bytes(opt, kept)
    state = opt.state_dict()  # through flush: the bucket written back, then mapped
    assert opt.store.kept_bytes == 0 and _file_bytes(opt, kept) != stale
    other.release_device_memory()
    assert _file_bytes(opt, kept) == _file_bytes(other, kept)
    reference = other.state_dict()
    for i, moments in reference["state"].items():
        for key, value in moments.items():
            assert torch.equal(state["state"][i][key], value), (i, key)
    opt.close()
    other.close()


def test_the_state_dict_lists_params_in_order_whatever_bucket_a_step_kept(disk_dir):
    # Steps take the kept bucket first and the largest last, so ``opt.state`` gains its
    # entries out of param order; torch's state dict lists them in order, and so does ours
    # (the host-cache test zipped two optimizers' values and compared different params).
    params, _ = twins(ODD_SHAPES)
    opt = _opt(params, disk_dir)
    for step in range(3):
        set_grads(params, step=step)
        opt.step()
        assert list(opt.state_dict()["state"]) == list(range(len(params)))
    opt.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_drops_the_kept_bucket_and_a_save_writes_it_first(disk_dir, device):
    ours, ref_params = twins(ODD_SHAPES, device=_device(device))
    opt = _opt(ours, os.path.join(disk_dir, "live"))
    ref = _adamw(ref_params)
    ckpt = os.path.join(disk_dir, "ckpt")
    for step in range(5):
        if step == 2:
            assert opt.store.kept_bytes > 0
            opt.save_checkpoint(ckpt)
            saved = [p.detach().clone() for p in ours], copy.deepcopy(ref.state_dict())
        set_grads(ours, ref_params, step=step)
        opt.step()
        ref.step()
    # Back to step 2: had the kept bucket (step 4's) survived the load, the next step
    # would start on it instead of the checkpoint's bytes.
    assert opt.store.kept_bytes > 0
    opt.load_checkpoint(ckpt)
    assert opt.store.kept_bytes == 0
    for p, r, v in zip(ours, ref_params, saved[0]):
        p.data.copy_(v)
        r.data.copy_(v)
    ref.load_state_dict(saved[1])
    for step in range(2, 5):
        set_grads(ours, ref_params, step=step)
        opt.step()
        ref.step()
        assert_state_equal(opt, ref, ours, ref_params)
    opt.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_write_back_keeps_the_bucket_and_a_retry_writes_it(disk_dir, fail_a_write_of, device):
    ours, twin = twins(ODD_SHAPES, device=_device(device))
    opt, other = _opt(ours, os.path.join(disk_dir, "a")), _opt(twin, os.path.join(disk_dir, "b"))
    set_grads(ours, twin, step=0)
    opt.step()
    other.step()
    kept = opt.store.held.kept.index
    fail_a_write_of(opt.store.path(kept))
    with pytest.raises(StorageError, match=r"bucket-\d+\.bin: write of .* Input/output error"):
        opt.release_device_memory()
    assert opt.store.kept_bytes > 0 and opt.store.device_bytes() > 0  # its buffer still holds the only copy
    opt.release_device_memory()
    other.release_device_memory()
    assert _file_bytes(opt, kept) == _file_bytes(other, kept)
    opt.close()
    other.close()


def test_an_optimizer_dropped_unclosed_writes_nothing_from_the_garbage_collector(disk_dir, monkeypatch):
    # Files that no one opens again: a write-back from a collection, which may run on
    # one of the engine's own threads, would only risk waiting on itself.
    params, _ = twins(ODD_SHAPES)
    with RankDir(disk_dir, job="kept", role="actor") as rank_dir:
        opt = _opt(params, rank_dir)
        set_grads(params, step=0)
        opt.step()
        assert opt.store.kept_bytes > 0
        writes = []
        real = statefile.pwrite_all
        monkeypatch.setattr(statefile, "pwrite_all", lambda *a: writes.append(a[3]) or real(*a))
        directory = opt.store.directory
        del opt
        gc.collect()
        assert writes == []
        assert not [n for n in os.listdir(directory) if n.endswith(".new")]
