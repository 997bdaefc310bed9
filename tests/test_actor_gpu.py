"""Actor offload on torch_memory_saver (GPU machine only: ``pytest -m gpu``).

Each case starts a fresh actor process with ``launch_env``'s environment (the hook must
be preloaded at start), trains a real model for two steps on CUDA, then sleeps and
wakes it three times: every param, grad, buffer and AdamW state tensor must come back
bit-identical at the same device address, and the device memory must be free while
the actor sleeps.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from greenroom import OffloadConfig, actor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import os, torch
from greenroom import OffloadConfig, actor
from greenroom.rankdir import RankDir
from greenroom.train.model import ModelConfig, Transformer
config = OffloadConfig(offload_train=True, offload_train_target={target!r}, offload_train_disk_dir={disk_dir!r},
                       offload_train_disk_chunk_mb=16)
with RankDir({disk_dir!r}, role="actor") as rd, actor.build_offloader(config, rd, device="cuda",
                                                                        backend="tms") as off:
    assert off.backend == "tms" and off.mover == {mover!r}
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=1024, n_layers=4, n_heads=8, max_seq_len=64)).cuda()
    model.register_buffer("counter", torch.arange(7, device="cuda"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    tokens = torch.randint(0, 512, (4, 64), device="cuda")
    for _ in range(2):
        optimizer.zero_grad(set_to_none=False)
        model(tokens).float().square().mean().backward()
        optimizer.step()
    off.track(model, optimizer)
    tensors = [*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers(),
               *(v for s in optimizer.state.values() for v in s.values() if v.is_cuda)]
    before = [t.detach().cpu().clone() for t in tensors]
    addresses = [t.data_ptr() for t in tensors]
    actor_bytes = sum(t.nbytes for t in off.tracked())
    for cycle in range(3):
        torch.cuda.synchronize()
        free_awake = torch.cuda.mem_get_info()[0]
        with off.asleep():
            with off.rollout_region():
                scratch = torch.full((1 << 20,), 3.0, device="cuda")  # the rollout's memory
            freed = torch.cuda.mem_get_info()[0] - free_awake + scratch.nbytes
            assert freed >= 0.9 * actor_bytes, (freed, actor_bytes)
            if {target!r} == "disk":
                assert os.listdir(os.path.join(rd.path, "offload")), "nothing in the rank's offload dir"
        assert [t.data_ptr() for t in tensors] == addresses, "addresses changed"
        for b, t in zip(before, tensors):
            assert torch.equal(b, t.detach().cpu()), "not bit-exact"
        del scratch
    optimizer.zero_grad(set_to_none=False)
    model(tokens).float().square().mean().backward()
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
print("ok", off.last_sleep.nbytes, round(off.last_sleep.seconds, 3), round(off.last_wake.seconds, 3))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("mover", ["greenroom", "tms"])
@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_tms_sleep_wake_is_bit_exact_at_the_same_addresses(disk_dir, target, mover):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (runs on the GPU machine)")
    config = OffloadConfig(offload_train=True, offload_train_target=target, offload_train_disk_dir=disk_dir,
                           offload_train_disk_chunk_mb=16)
    env = {**os.environ, **actor.launch_env(config, 0, job=f"gpu-{target}-{mover}", mover=mover),
           "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "runtime"), os.environ.get("PYTHONPATH", "")])}
    code = textwrap.dedent(CHILD).format(target=target, mover=mover, disk_dir=disk_dir)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    print(target, mover, result.stdout.strip())
    assert os.listdir(disk_dir) == []


@pytest.mark.gpu
def test_greenroom_train_on_cuda_relaunches_under_the_hook_and_learns(disk_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (runs on the GPU machine)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "runtime"),
                                                        os.environ.get("PYTHONPATH", "")])}
    metrics = os.path.join(disk_dir, "m.jsonl")
    result = subprocess.run(
        [sys.executable, "-m", "greenroom.cli", "train", "--offload-train", "--offload-train-target", "disk",
         "--offload-train-disk-dir", os.path.join(disk_dir, "offload"), "--iterations", "4", "--no-progress",
         "--metrics", metrics], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(tms)" in result.stdout
    assert len(open(metrics).readlines()) == 4
    assert os.listdir(os.path.join(disk_dir, "offload")) == []
