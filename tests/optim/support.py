"""Helpers for the StreamingAdam tests (no tests here): twin params, shared grads, state comparison."""

import torch

from greenroom.optim import StreamingAdam

ODD_SHAPES = [(7, 13), (1000,), (3, 5, 7), (33,), (2049, 3), (1,), (64, 65)]


def twins(shapes, *, dtype=torch.float32, seed=0, device="cpu"):
    """Two lists of identical leaf params of ``shapes``."""
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    make = lambda: [torch.nn.Parameter(v.clone().to(device)) for v in values]  # noqa: E731
    return make(), make()


def set_grads(*param_lists, step, skip=()):
    """The same pseudo-random grads on each list (in the params' dtype); None at ``skip``."""
    gen = torch.Generator().manual_seed(1000 + step)
    first = param_lists[0]
    grads = [torch.randn(p.shape, generator=gen) for p in first]
    for params in param_lists:
        for i, (p, g) in enumerate(zip(params, grads)):
            p.grad = None if i in skip else g.to(device=p.device, dtype=p.dtype).clone()


def step_beside_fp32_masters(opt, ref, ours, masters, *, step, dtype=torch.bfloat16):
    """One step of ``opt`` on the 16-bit ``ours`` and of ``ref`` on their fp32 ``masters``
    with the same grads; each param must then be its new master cast to ``dtype``."""
    set_grads(ours, step=step)
    for m, p in zip(masters, ours):
        m.grad = p.grad.float()
    opt.step()
    ref.step()
    for p, m in zip(ours, masters):
        assert p.dtype == dtype and torch.equal(p.detach(), m.detach().to(dtype))


def streamed_moments(opt: StreamingAdam) -> dict:
    """``{param: (exp_avg, exp_avg_sq)}`` decoded from the bucket files (fp32 copies)."""
    out = {}
    for state in opt.store.stream():
        for i, avg, sq in zip(state.bucket.entries, state.views(state.exp_avg), state.views(state.exp_avg_sq)):
            out[opt.streamed[i]] = (avg.clone(), sq.clone())
    return out


def assert_state_equal(opt: StreamingAdam, ref: torch.optim.Optimizer, ours_params, ref_params):
    """Params, steps and both moments bit-identical (``torch.equal``)."""
    for a, b in zip(ours_params, ref_params):
        assert torch.equal(a.detach(), b.detach())
    moments = streamed_moments(opt)
    for a, b in zip(ours_params, ref_params):
        if b not in ref.state:
            assert a not in opt.state
            continue
        assert torch.equal(opt.state[a]["step"].cpu(), ref.state[b]["step"].cpu())
        avg, sq = moments[a] if a in moments else (opt.state[a]["exp_avg"], opt.state[a]["exp_avg_sq"])
        assert torch.equal(avg, ref.state[b]["exp_avg"])
        assert torch.equal(sq, ref.state[b]["exp_avg_sq"])
