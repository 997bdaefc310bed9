"""``StreamingAdam.state_dict()`` / ``load_state_dict()`` in torch's format: both ways with
``torch.optim.AdamW`` bit-exact, through ``torch.save``, views of the files, refusals."""

import hashlib
import os

import pytest
import torch

from greenroom.errors import GreenroomError
from greenroom.optim import StreamingAdam
from tests.optim.support import ODD_SHAPES, assert_state_equal, set_grads, twins

SHAPES = [(256,), *ODD_SHAPES]  # the first stays resident


def _streaming(params, disk_dir, name="a", **kwargs):
    return StreamingAdam(
        params, lr=1e-2, weight_decay=0.05, state_dir=os.path.join(disk_dir, name), bucket_numel=3000, **kwargs
    )


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05, foreach=True)


def _run(opts_and_params, steps, skip=()):
    for step in steps:
        set_grads(*[params for _, params in opts_and_params], step=step, skip=skip if step == steps[0] else ())
        for opt, _ in opts_and_params:
            opt.step()


def _file_digests(opt):
    out = []
    for bucket in opt.store.buckets:
        with open(opt.store.path(bucket.index), "rb") as f:
            out.append(hashlib.sha256(f.read()).hexdigest())
    return out


def test_format_is_torchs(disk_dir):
    ours, ref_params = twins(SHAPES)
    opt, ref = _streaming(ours, disk_dir), _adamw(ref_params)
    assert opt.state_dict() == {
        "state": {},
        "param_groups": [
            {
                **ref.state_dict()["param_groups"][0],
                # the kernel that ran (foreach on the CPU)
                "fused": False,
                "foreach": True,
                "moment_dtype": "fp32",
            }
        ],
    }
    written = opt.store.bytes_written
    opt.load_state_dict(opt.state_dict())  # accelerate's prepare does this: no disk pass for an empty state
    assert opt.store.bytes_written == written
    _run([(opt, ours), (ref, ref_params)], [0], skip={2})
    sd, rsd = opt.state_dict(), ref.state_dict()
    assert sorted(sd["state"]) == sorted(rsd["state"]) == [0, 1, 3, 4, 5, 6, 7]
    for i, state in sd["state"].items():
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        for key in state:
            assert torch.equal(state[key], rsd["state"][i][key])
    opt.close()


@pytest.mark.parametrize("direction", ["adamw_to_streaming", "streaming_to_adamw"])
def test_switching_mid_run_is_bit_exact(disk_dir, direction):
    ours, ref_params = twins(SHAPES)
    opt, ref = _streaming(ours, disk_dir), _adamw(ref_params)
    _run([(opt, ours), (ref, ref_params)], [0, 1, 2], skip={4})
    second, second_params = twins(SHAPES)  # a fresh pair of params gets the state
    for a, b in zip(second_params, ours):
        a.data.copy_(b.detach())
    if direction == "adamw_to_streaming":
        new = _streaming(second_params, disk_dir, name="b")
        new.load_state_dict(ref.state_dict())
    else:
        new = _adamw(second_params)
        new.load_state_dict(opt.state_dict())
    _run([(new, second_params), (ref, ref_params)], [3, 4])
    if direction == "adamw_to_streaming":
        assert_state_equal(new, ref, second_params, ref_params)
    else:
        for a, b in zip(second_params, ref_params):
            assert torch.equal(a.detach(), b.detach())
        for a, b in zip(second_params, ref_params):
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(new.state[a][key], ref.state[b][key])
    opt.close()


@pytest.mark.parametrize(
    "dtype,moment_dtype", [(torch.float32, "fp32"), (torch.bfloat16, "fp32"), (torch.bfloat16, "bf16")]
)
def test_torch_save_and_resume_equal_the_uninterrupted_run(disk_dir, dtype, moment_dtype):
    ours, again = twins(SHAPES, dtype=dtype)
    opt = _streaming(ours, disk_dir, moment_dtype=moment_dtype)
    _run([(opt, ours)], [0, 1])
    path = os.path.join(disk_dir, "opt.pt")
    torch.save(opt.state_dict(), path)
    sd = torch.load(path, weights_only=True)
    if dtype == torch.bfloat16:
        assert all(s["master"].dtype == torch.float32 for i, s in sd["state"].items() if i > 0)
        assert sd["state"][1]["exp_avg"].dtype == (torch.bfloat16 if moment_dtype == "bf16" else torch.float32)
    for a, b in zip(again, ours):
        a.data.copy_(b.detach())
    resumed = _streaming(again, disk_dir, name="b", moment_dtype=moment_dtype)
    resumed.load_state_dict(sd)
    _run([(opt, ours), (resumed, again)], [2, 3])
    for a, b in zip(ours, again):
        assert torch.equal(a.detach(), b.detach())
    assert _file_digests(opt) == _file_digests(resumed)
    opt.close()
    resumed.close()


def test_state_dict_tensors_are_copy_on_write_views_of_the_files(disk_dir):
    ours, _ = twins(SHAPES)
    opt = _streaming(ours, disk_dir)
    _run([(opt, ours)], [0])
    before = _file_digests(opt)
    sd = opt.state_dict()
    storage = sd["state"][1]["exp_avg"].untyped_storage()
    assert storage.nbytes() == sd["state"][1]["exp_avg"].numel() * 4  # a view, not a copy of the bucket
    for state in sd["state"].values():
        state["exp_avg"].add_(1.0)  # a user writing the dict never writes the optimizer's files
    assert _file_digests(opt) == before
    opt.close()


def _mutations():
    def moment_dtype(sd):
        sd["param_groups"][0]["moment_dtype"] = "bf16"

    def param_count(sd):
        sd["param_groups"][0]["params"].append(99)

    def truncated(sd):
        sd["state"][3]["exp_avg_sq"] = sd["state"][3]["exp_avg_sq"].reshape(-1)[:-1]

    def narrow(sd):
        sd["state"][4]["exp_avg"] = sd["state"][4]["exp_avg"].to(torch.bfloat16)

    def amsgrad(sd):
        sd["param_groups"][0]["amsgrad"] = True

    def groups(sd):
        sd["param_groups"].append(dict(sd["param_groups"][0]))

    return [
        (moment_dtype, "moments are bf16"),
        (param_count, "8 params in the state dict, 7 here"),
        (truncated, "param 3's exp_avg_sq has shape"),
        (narrow, "param 4's exp_avg is torch.bfloat16"),
        (amsgrad, "amsgrad=True"),
        (groups, "2 param groups"),
    ]


@pytest.mark.parametrize("mutate,match", _mutations(), ids=lambda v: getattr(v, "__name__", ""))
def test_a_mismatched_state_dict_is_one_line_and_changes_nothing(disk_dir, mutate, match):
    shapes = ODD_SHAPES
    ours, _ = twins(shapes)
    opt = _streaming(ours, disk_dir)
    _run([(opt, ours)], [0, 1])
    sd = opt.state_dict()
    sd = {
        "state": {i: {k: v.clone() for k, v in s.items()} for i, s in sd["state"].items()},
        "param_groups": [dict(g, params=list(g["params"])) for g in sd["param_groups"]],
    }
    mutate(sd)
    before, steps = _file_digests(opt), [float(opt.state[p]["step"]) for p in ours]
    lr = opt.param_groups[0]["lr"]
    with pytest.raises(GreenroomError, match=match) as info:
        opt.load_state_dict(sd)
    assert "\n" not in str(info.value) and "nothing was changed" in str(info.value)
    assert _file_digests(opt) == before
    assert [float(opt.state[p]["step"]) for p in ours] == steps and opt.param_groups[0]["lr"] == lr
    opt.close()


def test_encoded_moment_dtypes_refuse_a_state_dict_in_one_line(disk_dir):
    p = torch.nn.Parameter(torch.randn(100_000))
    opt = StreamingAdam([p], state_dir=disk_dir, moment_dtype="fp8e4m3")
    with pytest.raises(GreenroomError, match="save_checkpoint"):
        opt.state_dict()
    opt.close()


def test_the_state_dict_does_not_depend_on_the_bucket_layout(disk_dir):
    ours, again = twins(SHAPES)
    opt = _streaming(ours, disk_dir)
    _run([(opt, ours)], [0, 1])
    for a, b in zip(again, ours):
        a.data.copy_(b.detach())
    other = StreamingAdam(
        again, lr=1e-2, weight_decay=0.05, state_dir=os.path.join(disk_dir, "b"), bucket_numel=1, resident_numel=0
    )  # one param per bucket; the (256,) one, resident in opt, streams here
    other.load_state_dict(opt.state_dict())
    _run([(opt, ours), (other, again)], [2, 3])
    for a, b in zip(ours, again):
        assert torch.equal(a.detach(), b.detach())
    mine, theirs = opt.state_dict(), other.state_dict()
    for i, state in mine["state"].items():
        for key, value in state.items():
            assert torch.equal(value, theirs["state"][i][key])
    opt.close()
    other.close()


def test_adamw_state_of_bf16_params_widens_exactly_into_fp32_moments(disk_dir):
    ours, ref_params = twins(ODD_SHAPES, dtype=torch.bfloat16)
    ref = _adamw(ref_params)
    _run([(ref, ref_params)], [0, 1])
    assert ref.state[ref_params[0]]["exp_avg"].dtype == torch.bfloat16  # AdamW keeps the param's dtype
    for a, b in zip(ours, ref_params):
        a.data.copy_(b.detach())
    opt = _streaming(ours, disk_dir, resident_numel=0)
    opt.load_state_dict(ref.state_dict())
    sd = opt.state_dict()
    for i, b in enumerate(ref_params):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sd["state"][i][key], ref.state[b][key].float())
        assert torch.equal(sd["state"][i]["master"], b.detach().float())  # no master in AdamW's: the param's
    bf16 = _streaming(twins(ODD_SHAPES, dtype=torch.bfloat16)[0], disk_dir, name="c", moment_dtype="bf16")
    with pytest.raises(GreenroomError, match="moments are fp32, this optimizer stores bf16"):
        bf16.load_state_dict(opt.state_dict())  # fp32 moments never narrow silently
    opt.close()
    bf16.close()
