"""``--stream-optimizer-state-host-cache-gb``: whole buckets in host memory instead of the
disk (``BucketStore`` Note [host cache]).

A cached run must be bit-identical to the uncached one (and to resident AdamW in fp32)
through steps, a checkpoint save and load in the middle, the state dict and its load;
the cached buckets' files must not be touched by a step, and must hold exactly what
the uncached run's files hold whenever something reads them (after ``flush``, a save,
``state_dict()``, ``close()``).
"""

import copy
import os

import pytest
import torch

from greenroom.dirs.rankdir import RankDir
from greenroom.optim import StreamingAdam
from greenroom.optim.store.bucket_store import BucketStore, Entry, build_buckets
from tests.optim.support import ODD_SHAPES, assert_state_equal, set_grads, twins

BUCKET_NUMEL = 1500  # ODD_SHAPES then make 4 buckets of 24, 84, 12 and 60 KiB of fp32 state


def _opt(params, state_dir, cache_bytes, **kwargs):
    kwargs = {"lr": 1e-2, "weight_decay": 0.01, "bucket_numel": BUCKET_NUMEL, "resident_numel": 0, **kwargs}
    return StreamingAdam(params, state_dir=state_dir, host_cache_gb=cache_bytes / 1e9, **kwargs)


def _files(opt_or_paths):
    """Each bucket file's bytes, by bucket index."""
    paths = opt_or_paths
    if isinstance(opt_or_paths, StreamingAdam):
        paths = [opt_or_paths.store.path(b.index) for b in opt_or_paths.store.buckets]
    out = {}
    for index, path in enumerate(paths):
        with open(path, "rb") as f:
            out[index] = f.read()
    return out


def _half(opt) -> int:
    """A budget of about half the state."""
    return sum(b.data_bytes for b in opt.store.buckets) // 2


def test_buckets_are_taken_in_order_while_they_fit(disk_dir):
    entries = [Entry(name=str(i), shape=(n,)) for i, n in enumerate([1000, 5000, 500, 3000])]
    sizes = [b.data_bytes for b in build_buckets(entries, 1, "fp32")]
    assert sizes == [12288, 61440, 12288, 36864]  # master, exp_avg, exp_avg_sq of each, 4 KiB aligned
    # In order, each while it still fits: a bucket too large for what is left is skipped.
    cases = {0: [], 12287: [], 12288: [0], 30000: [0, 2], 12288 + 61440: [0, 1], 61440: [0, 2, 3], 10**9: [0, 1, 2, 3]}
    for budget, cached in cases.items():
        directory = os.path.join(disk_dir, str(budget))
        os.makedirs(directory)
        store = BucketStore(entries, directory, bucket_numel=1, host_cache_bytes=budget)
        try:
            assert sorted(store.host_cache) == cached, budget
            assert store.host_cache_bytes == sum(sizes[i] for i in cached) <= budget
            assert store.disk_bytes_per_step == sum(b.file_bytes for b in store.buckets if b.index not in cached)
            # Every file still exists at its full size: running out of space stays a setup error.
            assert all(os.path.getsize(store.path(b.index)) == b.file_bytes for b in store.buckets)
        finally:
            store.close()


@pytest.mark.parametrize("cache", ["none-fits", "half", "all"])
def test_fp32_bit_identical_to_uncached_and_adamw_across_a_checkpoint(disk_dir, cache):
    ours, ref_params = twins(ODD_SHAPES)
    plain_params = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    plain = _opt(plain_params, os.path.join(disk_dir, "plain"), 0)
    budget = {"none-fits": 4095, "half": _half(plain), "all": 10**9}[cache]
    opt = _opt(ours, os.path.join(disk_dir, "cached"), budget)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.01, foreach=True)
    cached = sorted(opt.store.host_cache)
    assert {
        "none-fits": cached == [],
        "half": 0 < len(cached) < len(opt.store.buckets),
        "all": len(cached) == len(opt.store.buckets),
    }[cache]
    ckpt, plain_ckpt = os.path.join(disk_dir, "ckpt"), os.path.join(disk_dir, "plain-ckpt")
    for step in range(7):
        if step == 3:
            opt.save_checkpoint(ckpt)
            plain.save_checkpoint(plain_ckpt)
            saved = ([p.detach().clone() for p in ours], copy.deepcopy(ref.state_dict()))
            for name in os.listdir(plain_ckpt):  # the checkpoints are the same bytes
                if name.startswith("bucket-"):
                    with open(os.path.join(ckpt, name), "rb") as a, open(os.path.join(plain_ckpt, name), "rb") as b:
                        assert a.read() == b.read(), name
        if step == 5:
            # Go back to step 3: the cache must come back from the checkpoint, not keep step 5.
            opt.load_checkpoint(ckpt)
            plain.load_checkpoint(plain_ckpt)
            for p, q, r, v in zip(ours, plain_params, ref_params, saved[0]):
                for t in (p, q, r):
                    t.data.copy_(v)
            ref.load_state_dict(saved[1])
        set_grads(ours, plain_params, ref_params, step=step, skip={1} if step % 2 else {4})
        opt.step()
        plain.step()
        ref.step()
        assert_state_equal(opt, ref, ours, ref_params)
        assert_state_equal(plain, ref, plain_params, ref_params)
    opt.store.flush()
    # The bucket each keeps on the device goes to its file (optim.store.held Note [the last bucket stays]).
    plain.store.flush()
    assert _files(opt) == _files(plain)  # after a flush, the files hold exactly the uncached run's bytes
    opt.close()
    plain.close()


def test_a_step_does_not_touch_a_cached_buckets_file_and_moves_only_the_rest(disk_dir):
    ours, plain_params = twins(ODD_SHAPES)
    # One rank dir for both: their files outlive close() until it goes (a plain path's go with close()).
    rank_dir = RankDir(disk_dir, job="cache", role="actor").open()
    plain = _opt(plain_params, rank_dir, 0)
    opt = _opt(ours, rank_dir, 30000)
    cached = sorted(opt.store.host_cache)
    assert cached and len(cached) < len(opt.store.buckets)
    before = _files(opt)
    kept = 0  # no bucket is kept on the device before the first step
    for step in range(3):
        set_grads(ours, plain_params, step=step)
        read, written = opt.store.bytes_read, opt.store.bytes_written
        opt.step()
        plain.step()
        # Every uncached bucket but the one kept on the device between steps (optim.store.held
        # Note [the last bucket stays]): a step does not write it back, and the next does not read it.
        kept_before, kept = kept, opt.store.kept_bytes
        assert opt.store.bytes_read - read == opt.store.disk_bytes_per_step - kept_before
        assert opt.store.bytes_written - written == opt.store.disk_bytes_per_step - kept > 0
    after = _files(opt)
    for index in range(len(opt.store.buckets)):
        assert (after[index] == before[index]) == (index in cached), index
    paths = [[o.store.path(b.index) for b in o.store.buckets] for o in (opt, plain)]
    opt.close()
    plain.close()
    # close() writes the cached buckets out: the files then hold the state.
    assert _files(paths[0]) == _files(paths[1])
    rank_dir.close()


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
def test_state_dict_equals_the_uncached_one_and_its_load_refills_the_cache(disk_dir, moment_dtype):
    ours, plain_params = twins(ODD_SHAPES, dtype=torch.bfloat16)
    plain = _opt(plain_params, os.path.join(disk_dir, "plain"), 0, moment_dtype=moment_dtype)
    opt = _opt(ours, os.path.join(disk_dir, "cached"), _half(plain), moment_dtype=moment_dtype)
    assert opt.store.host_cache
    for step in range(3):
        set_grads(ours, plain_params, step=step)
        opt.step()
        plain.step()
    ours_sd, plain_sd = opt.state_dict(), plain.state_dict()
    assert ours_sd["state"].keys() == plain_sd["state"].keys()
    for i, state in plain_sd["state"].items():
        for key, value in state.items():
            assert torch.equal(ours_sd["state"][i][key], value), (i, key)
    snapshot = torch.load(_save(ours_sd, disk_dir), weights_only=True)
    for step in range(3, 5):  # move on, then load the snapshot back into the cached one only
        set_grads(ours, step=step)
        opt.step()
    opt.load_state_dict(snapshot)
    for p, q in zip(ours, plain_params):
        p.data.copy_(q)
    for step in range(3, 6):
        set_grads(ours, plain_params, step=step)
        opt.step()
        plain.step()
        for p, q in zip(ours, plain_params):
            assert torch.equal(p, q)
    opt.store.flush()
    plain.store.flush()  # its last bucket is on the device until then (optim.store.held Note [the last bucket stays])
    assert _files(opt) == _files(plain)
    opt.close()
    plain.close()


def _save(state_dict, directory):
    path = os.path.join(directory, "sd.pt")
    torch.save(state_dict, path)
    return path


def test_fresh_state_and_added_groups_go_to_the_cache(disk_dir):
    ours, plain_params = twins(ODD_SHAPES)
    plain = _opt(plain_params[:4], os.path.join(disk_dir, "plain"), 0)
    opt = _opt(ours[:4], os.path.join(disk_dir, "cached"), 10**9)
    for o, params in ((opt, ours), (plain, plain_params)):
        o.add_param_group({"params": params[4:], "lr": 3e-3})
    assert len(opt.store.host_cache) == len(opt.store.buckets)  # the new buckets too, budget permitting
    for step in range(3):
        set_grads(ours, plain_params, step=step)
        opt.step()
        plain.step()
    for p, q in zip(ours, plain_params):
        assert torch.equal(p, q)
    opt.initialize_state()
    plain.initialize_state()
    opt.store.flush()
    plain.store.flush()
    assert _files(opt) == _files(plain)
    opt.close()
    plain.close()


def test_host_cache_gb_must_be_a_finite_non_negative_number(disk_dir):
    params, _ = twins(ODD_SHAPES[:1])
    for bad in (-1, float("nan"), float("inf"), "1", True):
        with pytest.raises(ValueError, match=r"^StreamingAdam: host_cache_gb must be a finite number of GB >= 0"):
            StreamingAdam(params, state_dir=disk_dir, host_cache_gb=bad)
    assert not os.listdir(disk_dir)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("compression", ["none", "auto"])
def test_cuda_pinned_cache_is_bit_identical_to_uncached_and_fused_adamw(disk_dir, moment_dtype, compression):
    shapes = [(1024, 1024), (4096,), (333, 777), (2048, 512), (65537,)]
    ours, plain_params = twins(shapes, device="cuda")
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    plain = _opt(
        plain_params,
        os.path.join(disk_dir, "plain"),
        0,
        bucket_numel=1 << 19,
        moment_dtype=moment_dtype,
        compression=compression,
    )
    opt = _opt(
        ours,
        os.path.join(disk_dir, "cached"),
        _half(plain),
        bucket_numel=1 << 19,
        moment_dtype=moment_dtype,
        compression=compression,
    )
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.01, fused=True)
    assert 0 < len(opt.store.host_cache) < len(opt.store.buckets)
    assert all(t.is_pinned() for t in opt.store.host_cache.values())
    ckpt = os.path.join(disk_dir, "ckpt")
    for step in range(6):
        if step == 3:
            opt.save_checkpoint(ckpt)
            opt.load_checkpoint(ckpt)
        set_grads(ours, plain_params, ref_params, step=step)
        for o in (opt, plain, ref):
            o.step()
        for p, q, r in zip(ours, plain_params, ref_params):
            assert torch.equal(p, q)
            if moment_dtype == "fp32":
                assert torch.equal(p, r)
    if moment_dtype == "fp32":
        assert_state_equal(opt, ref, ours, ref_params)
    opt.store.flush()
    plain.store.flush()  # its kept bucket too (optim.store.held Note [the last bucket stays])
    if opt.store.compression is None:
        assert _files(opt) == _files(plain)
    else:  # the cached buckets go out from host memory, stored raw by
        # the device codec, and a packed chunk leaves older bytes past its stored ones
        # By param index: the two dicts need not list the params in one order (the
        # cached optimizer's load at step 3 refilled its state in another), and zipping
        # their values compared different params' moments (seen on an H100).
        cached, uncached = opt.state_dict()["state"], plain.state_dict()["state"]
        assert cached.keys() == uncached.keys()
        for i in cached:
            assert cached[i].keys() == uncached[i].keys()
            assert all(torch.equal(cached[i][k], uncached[i][k]) for k in cached[i]), i
    opt.close()
    plain.close()
