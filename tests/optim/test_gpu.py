"""StreamingAdam on CUDA: bit-identical to fused (and foreach) torch.optim.AdamW; narrow
moments cast on the device to the same bytes as on the CPU. Runs with ``pytest -m gpu``."""

import os

import pytest
import torch

from greenroom.config import MOMENT_DTYPES
from greenroom.optim import StreamingAdam
from greenroom.optim.moments import moment_codecs
from tests.optim.support import ODD_SHAPES, assert_state_equal, set_grads, step_beside_fp32_masters, twins

pytestmark = pytest.mark.gpu


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (runs on the GPU machine)")


@pytest.mark.parametrize("impl", ["fused", "foreach"])
@pytest.mark.parametrize("bucket_numel", [1, 1500, 10_000_000])
def test_cuda_fp32_bit_identical_to_adamw(disk_dir, impl, bucket_numel):
    _cuda()
    ours, ref_params = twins(ODD_SHAPES, device="cuda")
    kw = {impl: True}
    groups = lambda ps: [{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-3, "weight_decay": 0.1}]  # noqa: E731
    opt = StreamingAdam(
        groups(ours),
        lr=1e-2,
        weight_decay=0.01,
        state_dir=disk_dir,
        bucket_numel=bucket_numel,
        resident_numel=100,
        **kw,
    )
    assert opt.fused == (impl == "fused")
    ref = torch.optim.AdamW(groups(ref_params), lr=1e-2, weight_decay=0.01, **kw)
    sched = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=6) for o in (opt, ref)]
    for step in range(6):
        set_grads(ours, ref_params, step=step, skip={1} if step % 2 else ())
        opt.step()
        ref.step()
        for s in sched:
            s.step()
        assert_state_equal(opt, ref, ours, ref_params)
    path = os.path.join(disk_dir, "ckpt")
    opt.save_checkpoint(path)
    opt.load_checkpoint(path)
    set_grads(ours, ref_params, step=99)
    opt.step()
    ref.step()
    assert_state_equal(opt, ref, ours, ref_params)
    opt.close()


def test_cuda_default_is_fused_and_bf16_params_match_fused_fp32_masters(disk_dir):
    _cuda()
    ours, _ = twins(ODD_SHAPES, dtype=torch.bfloat16, device="cuda")
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]
    opt = StreamingAdam(ours, lr=1e-2, weight_decay=0.1, state_dir=disk_dir, bucket_numel=3000)
    assert opt.fused
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(5):
        step_beside_fp32_masters(opt, ref, ours, masters, step=step)
    opt.close()


@pytest.mark.parametrize("name", [n for n in MOMENT_DTYPES if n != "fp32"])
def test_moment_casts_on_the_device_give_the_cpu_bytes(name):
    _cuda()
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(100_003, generator=gen) * torch.logspace(-10, 1, 100_003)
    for codec, v in zip(moment_codecs(name), (values, values**2)):
        cpu = torch.zeros(codec.nbytes(v.numel()), dtype=torch.uint8)
        codec.encode(v, cpu)
        gpu = torch.zeros_like(cpu, device="cuda")
        codec.encode(v.cuda(), gpu)
        assert torch.equal(gpu.cpu(), cpu)


@pytest.mark.parametrize("direction", ["adamw_to_streaming", "streaming_to_adamw"])
def test_cuda_state_dict_switches_with_fused_adamw_bit_exactly(disk_dir, direction):
    _cuda()
    shapes = [(256,), *ODD_SHAPES]  # the first stays resident
    ours, ref_params = twins(shapes, device="cuda")
    opt = StreamingAdam(ours, lr=1e-2, state_dir=os.path.join(disk_dir, "a"), bucket_numel=3000)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, fused=True)
    for step in range(3):
        set_grads(ours, ref_params, step=step, skip={4} if step == 0 else ())
        opt.step()
        ref.step()
    second, _ = twins(shapes, device="cuda")
    for a, b in zip(second, ours):
        a.data.copy_(b.detach())
    if direction == "adamw_to_streaming":
        new = StreamingAdam(second, lr=1e-2, state_dir=os.path.join(disk_dir, "b"), bucket_numel=3000)
        new.load_state_dict(ref.state_dict())
    else:
        new = torch.optim.AdamW(second, lr=1e-2, fused=True)
        new.load_state_dict(opt.state_dict())  # CPU views of the files; AdamW moves them to the GPU
    for step in range(3, 5):
        set_grads(second, ref_params, step=step)
        new.step()
        ref.step()
    for a, b in zip(second, ref_params):
        assert torch.equal(a.detach(), b.detach())
    if direction == "adamw_to_streaming":
        assert_state_equal(new, ref, second, ref_params)
        new.close()
    opt.close()


def test_cuda_bf16_weights_loaded_after_construction_are_followed(disk_dir):
    _cuda()
    ours, _ = twins(ODD_SHAPES, dtype=torch.bfloat16, device="cuda")
    opt = StreamingAdam(ours, lr=1e-2, weight_decay=0.1, state_dir=disk_dir, bucket_numel=3000)
    loaded, _ = twins(ODD_SHAPES, dtype=torch.bfloat16, seed=5, device="cuda")
    for p, new in zip(ours, loaded):
        p.data.copy_(new)
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        step_beside_fp32_masters(opt, ref, ours, masters, step=step)
    opt.close()
