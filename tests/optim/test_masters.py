"""Note [masters follow the params]: weights written after the optimizer was built (a
model.load_state_dict, p.data.copy_, an EMA swap) are what the next step updates."""

import torch

from greenroom.optim import StreamingAdam
from tests.optim.support import ODD_SHAPES, assert_state_equal, set_grads, step_beside_fp32_masters, twins


def _masters_in_files(opt):
    out = {}
    for state in opt.store.stream():
        for i, view in zip(state.bucket.entries, state.views(state.master)):
            out[opt.streamed[i]] = view.clone()
    return out


def test_bf16_weights_loaded_after_construction_are_the_ones_trained(disk_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 8)).to(torch.bfloat16)
    opt = StreamingAdam(model.parameters(), lr=1e-6, state_dir=disk_dir, resident_numel=0)
    torch.manual_seed(1)
    loaded = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 8)).to(torch.bfloat16).state_dict()
    model.load_state_dict(loaded)
    # The reference: fp32 masters taken from the loaded weights, stepped by torch's AdamW.
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    ref = torch.optim.AdamW(masters, lr=1e-6, foreach=True)
    set_grads(list(model.parameters()), step=0)
    for m, p in zip(masters, model.parameters()):
        m.grad = p.grad.float()
    opt.step()
    ref.step()
    for (name, p), m in zip(model.named_parameters(), masters):
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16)), name
        assert (p.detach().float() - loaded[name].float()).abs().max() < 1e-2  # not the init weights
    files = _masters_in_files(opt)
    for p, m in zip(model.parameters(), masters):
        assert torch.equal(files[p], m.detach())
    opt.close()


def test_params_changed_between_steps_reseed_only_the_changed_elements(disk_dir, monkeypatch):
    monkeypatch.setattr("greenroom.optim.streamed._FOLLOW_PIECE", 100)  # several pieces per param
    ours, _ = twins(ODD_SHAPES, dtype=torch.bfloat16)
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]
    # Whole fp32 masters: the per-element rule (remainders re-seed per block, tests/optim/test_remainder.py).
    opt = StreamingAdam(ours, lr=1e-2, weight_decay=0.1, state_dir=disk_dir, bucket_numel=3000, master_layout="fp32")
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, foreach=True)
    gen = torch.Generator().manual_seed(7)
    for step in range(6):
        if step == 2:  # an EMA-style swap of whole params
            for p, m in zip(ours[:3], masters[:3]):
                new = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
                p.data.copy_(new)
                m.data.copy_(new.float())
        if step == 4:  # part of one param: the other elements keep their fp32 master bits
            p, m = ours[6], masters[6]
            new = torch.randn(p.shape[1], generator=gen).to(torch.bfloat16)
            p.data[3].copy_(new)
            m.data[3].copy_(new.float())
        step_beside_fp32_masters(opt, ref, ours, masters, step=step)
    files = _masters_in_files(opt)
    for p, m in zip(ours, masters):
        assert torch.equal(files[p], m.detach())
    opt.close()


def test_fp32_weights_loaded_after_construction_match_adamw(disk_dir):
    ours, ref_params = twins(ODD_SHAPES, seed=3)
    opt = StreamingAdam(ours, lr=1e-2, state_dir=disk_dir, bucket_numel=3000)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, foreach=True)
    loaded, _ = twins(ODD_SHAPES, seed=4)
    for a, b, new in zip(ours, ref_params, loaded):
        a.data.copy_(new)
        b.data.copy_(new)
    for step in range(3):
        set_grads(ours, ref_params, step=step)
        opt.step()
        ref.step()
    assert_state_equal(opt, ref, ours, ref_params)
    opt.close()
