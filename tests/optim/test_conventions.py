"""torch.optim's conventions: AdamW's defaults and group keys, add_param_group, frozen params,
refused keys, a torch.compile'd model, and DCP's state probe."""

import os

import pytest
import torch

from greenroom.dirs.rankdir import RankDir
from greenroom.errors import ConfigError, GreenroomError, StorageError
from greenroom.io.engine import StateFile, align_up
from greenroom.optim import StreamingAdam, StreamingMuon
from tests.optim.support import ODD_SHAPES, assert_state_equal, set_grads, twins
from tests.train.test_faults import full_fs  # noqa: F401 (a fixture)


def test_defaults_and_group_keys_are_adamws(disk_dir):
    p, q = torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(10))
    opt, ref = StreamingAdam([p], state_dir=disk_dir), torch.optim.AdamW([q])
    assert opt.defaults == ref.defaults
    assert opt.param_groups[0].keys() == ref.param_groups[0].keys()
    opt.close()


@pytest.mark.parametrize(
    "key,value",
    [
        ("amsgrad", True),
        ("maximize", True),
        ("capturable", True),
        ("differentiable", True),
        ("decoupled_weight_decay", False),
    ],
)
def test_unimplemented_group_keys_are_refused_by_name(disk_dir, key, value):
    p = torch.nn.Parameter(torch.randn(10))
    with pytest.raises(ValueError, match=f"{key}={value}"):
        StreamingAdam([{"params": [p], key: value}], state_dir=disk_dir)


def test_add_param_group_appends_buckets_and_stays_exact(disk_dir):
    ours, ref_params = twins(ODD_SHAPES)
    extra = [torch.nn.Parameter(torch.randn(50, 7).to(torch.bfloat16))]  # a master for the new bucket, too
    opt = StreamingAdam(ours[:4], lr=1e-2, state_dir=disk_dir, bucket_numel=3000, resident_numel=0)
    ref = torch.optim.AdamW(ref_params[:4], lr=1e-2, foreach=True)
    set_grads(ours[:4], ref_params[:4], step=0)
    opt.step()
    ref.step()
    before = len(opt.store.buckets)
    opt.add_param_group({"params": ours[4:], "lr": 3e-3, "weight_decay": 0.2})
    ref.add_param_group({"params": ref_params[4:], "lr": 3e-3, "weight_decay": 0.2})
    assert len(opt.store.buckets) > before
    assert sorted(os.listdir(opt.state_dir)) == [f"bucket-{i:05d}.bin" for i in range(len(opt.store.buckets))]
    for step in range(1, 4):
        set_grads(ours, ref_params, step=step)
        opt.step()
        ref.step()
    assert_state_equal(opt, ref, ours, ref_params)
    opt.add_param_group({"params": extra})
    masters = [torch.nn.Parameter(extra[0].detach().float().clone())]
    ref.add_param_group({"params": masters})
    set_grads(extra, step=9)
    masters[0].grad = extra[0].grad.float()
    opt.step()
    ref.step()
    assert torch.equal(extra[0].detach(), masters[0].detach().to(torch.bfloat16))
    with pytest.raises(ValueError, match="amsgrad=True"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))], "amsgrad": True})
    opt.close()


def test_frozen_params_get_no_state_and_a_grad_on_one_is_refused(disk_dir):
    frozen = torch.nn.Parameter(torch.randn(100_000), requires_grad=False)
    trained = torch.nn.Parameter(torch.randn(100_000))
    opt = StreamingAdam([frozen, trained], state_dir=disk_dir)
    assert [id(p) for p in opt.streamed] == [id(trained)]
    # its two moments (and their checksum table), nothing for the frozen one
    assert opt.store.state_bytes == StateFile.file_bytes(2 * align_up(100_000 * 4), checksums="file")
    frozen.grad = torch.ones_like(frozen)
    with pytest.raises(GreenroomError, match="param 0.0 has a grad but had requires_grad=False"):
        opt.step()
    opt.close()


def test_a_torch_compiled_model_trains_like_adamw(disk_dir):
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))

    ours, ref = build(), build()
    # aot_eager traces forward and backward through dynamo and AOTAutograd like inductor does,
    # without a C++ compile: the optimizer sees exactly the params and grads a compiled model has.
    ours_c, ref_c = torch.compile(ours, backend="aot_eager"), torch.compile(ref, backend="aot_eager")
    opt = StreamingAdam(ours_c.parameters(), lr=1e-2, state_dir=disk_dir, resident_numel=0)
    ref_opt = torch.optim.AdamW(ref_c.parameters(), lr=1e-2, foreach=True)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 4, generator=gen)
        for model, o in ((ours_c, opt), (ref_c, ref_opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            o.step()
    assert_state_equal(opt, ref_opt, list(ours.parameters()), list(ref.parameters()))
    opt.close()


def test_dcp_state_probe_takes_no_step_and_no_io(disk_dir):
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    ours, _ = twins(ODD_SHAPES)
    opt = StreamingAdam(ours, lr=1e-2, state_dir=disk_dir, bucket_numel=3000)
    read, written = opt.store.bytes_read, opt.store.bytes_written
    _init_optim_state(opt)
    assert opt.store.bytes_read == read and opt.store.bytes_written == written
    assert all(float(opt.state[p]["step"]) == 0 for p in ours)
    assert opt.param_groups[0]["lr"] == 1e-2 and all(p.grad is None for p in ours)
    assert sorted(opt.state_dict()["state"]) == list(range(len(ours)))  # a template to load into
    opt.close()


def test_a_refused_param_group_changes_nothing(disk_dir):
    p = torch.nn.Parameter(torch.randn(100_000))
    opt = StreamingAdam([p], state_dir=disk_dir)
    with pytest.raises(ValueError, match="int64"):
        opt.add_param_group({"params": [torch.zeros(3, dtype=torch.int64)]})
    with pytest.raises(ValueError, match="meta"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3, device="meta"))]})
    assert len(opt.param_groups) == 1 and len(opt.store.buckets) == 1
    opt.close()


def test_a_param_group_with_no_room_for_its_files_is_taken_back_out(full_fs):  # noqa: F811
    """``add_param_group`` whose second new bucket file finds the disk full (a 256 KiB
    tmpfs): the error names the file, no new file is left, and the group is not in
    ``param_groups`` (left in, its params would never have been stepped); the optimizer
    steps on like AdamW over the groups it has."""
    with RankDir(full_fs, job="j", allow_tmpfs=True) as rank_dir:
        ours, theirs = twins([(2000,)])
        opt = StreamingAdam(ours, lr=1e-2, state_dir=rank_dir, bucket_numel=2000, resident_numel=0)
        try:
            ref = torch.optim.AdamW(theirs, lr=1e-2, foreach=opt.foreach, fused=opt.fused)
            files = sorted(os.listdir(opt.state_dir))
            extra = [torch.nn.Parameter(torch.randn(8000)) for _ in range(4)]
            with pytest.raises(StorageError, match=r"bucket-0000\d\.bin: not enough space to preallocate"):
                opt.add_param_group({"params": extra, "lr": 3e-3})
            assert len(opt.param_groups) == 1 and len(opt.store.buckets) == 1 and len(opt.streamed) == 1
            assert sorted(os.listdir(opt.state_dir)) == files
            for step in range(2):
                set_grads(ours, theirs, step=step)
                for p in extra:
                    p.grad = torch.ones_like(p)
                opt.step()
                ref.step()
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
        finally:
            opt.close()


def test_a_muon_param_group_refused_after_torch_appended_it_is_taken_back_out(disk_dir):
    """StreamingMuon checks a new group's params after torch's ``add_param_group`` appends
    it (an empty matrix): the refusal takes the group back out rather than leave it in, half classified."""
    w = torch.nn.Parameter(torch.randn(64, 64))
    opt = StreamingMuon([w], lr=0.02, state_dir=disk_dir)
    with pytest.raises(ConfigError, match="has no elements"):
        opt.add_param_group(
            {"params": [torch.nn.Parameter(torch.randn(32, 32)), torch.nn.Parameter(torch.zeros(0, 8))]}
        )
    assert len(opt.param_groups) == 1 and len(opt.streamed) == 1 and len(opt.store.buckets) == 1
    w.grad = torch.randn(64, 64)
    opt.step()
    opt.close()


@pytest.mark.parametrize(
    "key, value", [("maximize", True), ("amsgrad", True), ("decoupled_weight_decay", False), ("lr", torch.tensor(1e-3))]
)
def test_a_group_key_set_after_construction_that_the_step_does_not_implement_is_refused(disk_dir, key, value):
    """AdamW honours maximize, amsgrad and coupled decay set in param_groups between
    steps; the streamed step ignored them without a word (a tensor lr failed mid-step)."""
    ours, _ = twins(ODD_SHAPES)
    opt = StreamingAdam(ours, lr=1e-2, state_dir=disk_dir, bucket_numel=3000)
    set_grads(ours, step=0)
    opt.step()
    before = [p.detach().clone() for p in ours]
    opt.param_groups[0][key] = value
    set_grads(ours, step=1)
    with pytest.raises(ConfigError, match=rf"param_groups\[0\]\['{key}'\] is "):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ours, before))  # refused before any change
    opt.close()


def test_params_added_removed_or_replaced_in_a_group_are_refused_at_the_step(disk_dir):
    """AdamW trains params put into ``param_groups[i]['params']``; the streamed state is
    laid out once, so the step would train the old list silently: it refuses instead."""
    ours, _ = twins(ODD_SHAPES)
    opt = StreamingAdam(ours, lr=1e-2, state_dir=disk_dir, bucket_numel=3000)
    params = opt.param_groups[0]["params"]
    for changed in (
        params + [torch.nn.Parameter(torch.randn(10))],
        params[1:],
        [torch.nn.Parameter(p.detach().clone()) for p in params],
    ):
        opt.param_groups[0]["params"] = changed
        set_grads(changed, step=0)
        with pytest.raises(ConfigError, match=r"param_groups\[0\]\['params'\] changed since the state was laid out"):
            opt.step()
    opt.param_groups[0]["params"] = params
    set_grads(params, step=0)
    opt.step()
    opt.close()


def test_a_param_listed_twice_in_a_group_and_a_tensor_lr_are_refused_at_construction(disk_dir):
    p = torch.nn.Parameter(torch.randn(100, 100))
    with pytest.warns(UserWarning, match="duplicate parameters"):  # torch only warns
        with pytest.raises(ConfigError, match="param 0.1 is listed twice in its group"):
            StreamingAdam([p, p], state_dir=disk_dir)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        with pytest.raises(ConfigError, match="is listed twice in its group"):
            StreamingMuon([p, p], state_dir=disk_dir)
    with pytest.raises(ConfigError, match="lr as a tensor is not supported"):
        StreamingAdam([p], lr=torch.tensor(1e-3), state_dir=disk_dir)
    assert os.listdir(disk_dir) == []
