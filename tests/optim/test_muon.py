"""StreamingMuon against torch.optim.Muon: bit-identical params and momentum (torch.equal),
its state dict in torch's format, checkpoints (copied and in the step), and refusals by name.

A small transformer (``greenroom.train.model.Transformer``) trains 5 steps twice from the
same weights on the same batches: its 2-D params under ``torch.optim.Muon`` in one run
and under ``StreamingMuon`` (several buckets, two param groups) in the other, the rest
under the same AdamW in both."""

import copy
import os

import pytest
import torch

from greenroom.errors import CheckpointError, ConfigError
from greenroom.optim import StreamingAdam, StreamingMuon
from greenroom.train.model import ModelConfig, Transformer

STEPS = 5


def _model(seed=0, dtype=torch.float32, device="cpu"):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)).to(
        device=device, dtype=dtype
    )


def _split(model):
    matrices = [p for p in model.parameters() if p.ndim == 2]
    return [{"params": matrices[:3]}, {"params": matrices[3:], "lr": 0.01, "weight_decay": 0.05}], [
        p for p in model.parameters() if p.ndim != 2
    ]


def _batch(step, device):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 16, (4, 12), generator=gen).to(device)


def _train(model, muon, adam, steps, start=0):
    for step in range(start, start + steps):
        muon.zero_grad()
        adam.zero_grad()
        seq = _batch(step, next(model.parameters()).device)
        logits = model(seq[:, :-1])
        torch.nn.functional.cross_entropy(logits.float().reshape(-1, 16), seq[:, 1:].reshape(-1)).backward()
        muon.step()
        adam.step()


def _pair(state_dir, device="cpu", **kwargs):
    """(torch model, Muon, AdamW), (our model, StreamingMuon, AdamW), same weights."""
    ref = _model(device=device)
    ours = copy.deepcopy(ref)
    ref_groups, ref_rest = _split(ref)
    our_groups, our_rest = _split(ours)
    ref_opt = torch.optim.Muon(ref_groups, lr=0.02, momentum=0.9)
    our_opt = StreamingMuon(our_groups, lr=0.02, momentum=0.9, state_dir=state_dir, **{"bucket_numel": 3000, **kwargs})
    return (ref, ref_opt, torch.optim.AdamW(ref_rest, lr=1e-3)), (ours, our_opt, torch.optim.AdamW(our_rest, lr=1e-3))


def _assert_same(ref, ref_opt, ours, our_opt):
    for (name, a), b in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(a, b), name
    theirs = ref_opt.state_dict()["state"]
    mine = our_opt.state_dict()["state"]
    assert list(theirs) == list(mine)  # the same params, listed in torch's order too
    for i in theirs:
        assert torch.equal(
            theirs[i]["momentum_buffer"], mine[i]["momentum_buffer"].to(theirs[i]["momentum_buffer"].device)
        ), i


def test_bit_identical_to_torch_muon_after_5_steps(disk_dir):
    (ref, ref_opt, ref_adam), (ours, our_opt, our_adam) = _pair(disk_dir)
    assert len(our_opt.store.buckets) > 2
    _train(ref, ref_opt, ref_adam, STEPS)
    _train(ours, our_opt, our_adam, STEPS)
    _assert_same(ref, ref_opt, ours, our_opt)
    our_opt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bit_identical_to_torch_muon_on_cuda(disk_dir):
    (ref, ref_opt, ref_adam), (ours, our_opt, our_adam) = _pair(disk_dir, device="cuda", compression="none")
    _train(ref, ref_opt, ref_adam, STEPS)
    _train(ours, our_opt, our_adam, STEPS)
    _assert_same(ref, ref_opt, ours, our_opt)
    our_opt.close()


def test_state_dicts_load_both_ways_and_training_stays_identical(disk_dir):
    (ref, ref_opt, ref_adam), (ours, our_opt, our_adam) = _pair(os.path.join(disk_dir, "a"))
    _train(ref, ref_opt, ref_adam, 2)
    _train(ours, our_opt, our_adam, 2)
    # torch's dict into a fresh StreamingMuon over the same weights, and ours into torch's.
    fresh_groups, _ = _split(ours)
    fresh = StreamingMuon(fresh_groups, lr=0.02, momentum=0.9, state_dir=os.path.join(disk_dir, "b"), bucket_numel=3000)
    fresh.load_state_dict(ref_opt.state_dict())
    ref_opt.load_state_dict({**our_opt.state_dict(), "param_groups": ref_opt.state_dict()["param_groups"]})
    our_opt.close()
    _train(ref, ref_opt, ref_adam, 3, start=2)
    _train(ours, fresh, our_adam, 3, start=2)
    _assert_same(ref, ref_opt, ours, fresh)
    fresh.close()


@pytest.mark.parametrize("in_step", [False, True], ids=["save_checkpoint", "in-step"])
def test_checkpoint_round_trip_is_bit_identical(disk_dir, in_step):
    (ref, ref_opt, ref_adam), (ours, our_opt, our_adam) = _pair(os.path.join(disk_dir, "live"))
    path = os.path.join(disk_dir, "ckpt")
    _train(ref, ref_opt, ref_adam, 3)
    if in_step:
        _train(ours, our_opt, our_adam, 2)
        our_opt.checkpoint_next_step(path)
        _train(ours, our_opt, our_adam, 1, start=2)
        assert our_opt.last_checkpoint.extra_bytes_read == 0
    else:
        _train(ours, our_opt, our_adam, 3)
        our_opt.save_checkpoint(path)
    saved, saved_adam = copy.deepcopy(ours.state_dict()), copy.deepcopy(our_adam.state_dict())
    _train(ours, our_opt, our_adam, 1, start=3)  # moves on; the load must bring step 3 back
    ours.load_state_dict(saved)
    our_adam.load_state_dict(saved_adam)
    our_opt.load_checkpoint(path)
    _train(ref, ref_opt, ref_adam, 2, start=3)
    _train(ours, our_opt, our_adam, 2, start=3)
    _assert_same(ref, ref_opt, ours, our_opt)
    our_opt.close()


def test_refuses_what_muon_does_not_take_by_name(disk_dir):
    model = _model()
    with pytest.raises(ConfigError, match=r"param 0\.1 has size \(32,\); Muon only supports 2D parameters"):
        StreamingMuon([model.embed.weight, model.blocks[0].norm1.weight], state_dir=disk_dir)
    named = [("blocks.0.norm1.bias", model.blocks[0].norm1.bias)]
    with pytest.raises(ConfigError, match="'blocks.0.norm1.bias'"):
        StreamingMuon(named, state_dir=disk_dir)
    assert not os.listdir(disk_dir)


def test_an_adam_checkpoint_is_refused_by_muon(disk_dir):
    weight = torch.nn.Parameter(torch.randn(64, 64))
    adam = StreamingAdam([weight], state_dir=os.path.join(disk_dir, "adam"), resident_numel=0)
    adam.save_checkpoint(os.path.join(disk_dir, "ckpt"))
    adam.close()
    muon = StreamingMuon([weight], state_dir=os.path.join(disk_dir, "muon"))
    with pytest.raises(
        CheckpointError,
        match=r"two Adam moments \(StreamingAdam\) per param, this optimizer keeps "
        r"a momentum buffer \(StreamingMuon\)",
    ):
        muon.load_checkpoint(os.path.join(disk_dir, "ckpt"))
    muon.close()


def test_bf16_params_step_an_fp32_master_with_fp32_momentum(disk_dir):
    """16-bit params: the update runs on an fp32 master with fp32 momentum (torch's Muon
    updates the bf16 param and keeps bf16 momentum), so the reference is torch.optim.Muon
    on an fp32 param that starts at the bf16 values and gets the same grads, widened."""
    param = torch.nn.Parameter(torch.randn(48, 40).to(torch.bfloat16))
    master = torch.nn.Parameter(param.detach().float())
    ref = torch.optim.Muon([master], lr=0.02)
    opt = StreamingMuon([param], lr=0.02, state_dir=disk_dir)
    for step in range(3):
        grad = torch.randn(48, 40, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        param.grad, master.grad = grad, grad.float()
        ref.step()
        opt.step()
    state = opt.state_dict()["state"][0]
    assert state["master"].dtype == torch.float32 and state["momentum_buffer"].dtype == torch.float32
    assert torch.equal(state["master"], master)
    assert torch.equal(state["momentum_buffer"], ref.state[master]["momentum_buffer"])
    assert torch.equal(param, master.detach().to(torch.bfloat16))
    opt.close()
