"""The portable offload backend: what runs on the CPU machines and in CI.

A real model (the train job's transformer plus a BatchNorm for buffers) trained for a
step, so params, grads, buffers and AdamW state all exist; several sleep/wake cycles
to host memory and to disk must restore every byte (torch.equal), free the memory while
asleep, and leave no file behind.
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from greenroom import OffloadConfig, actor
from greenroom.dirs.rankdir import RankDir
from greenroom.train.model import ModelConfig, Transformer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Actor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lm = Transformer(ModelConfig(vocab_size=12, d_model=32, n_layers=2, n_heads=4, max_seq_len=10))
        self.norm = torch.nn.BatchNorm1d(12)  # running_mean/var and num_batches_tracked: buffers

    def forward(self, tokens):
        return self.norm(self.lm(tokens).transpose(1, 2)).transpose(1, 2)


def trained_actor():
    """Two steps, then one more backward: the grads are live (the step that consumes
    them has not run), so a sleep must keep them."""
    torch.manual_seed(0)
    model = Actor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 12, (4, 10))
    for _ in range(2):
        optimizer.zero_grad(set_to_none=False)
        model(tokens).square().mean().backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    model(tokens).square().mean().backward()
    return model, optimizer


def snapshot(model, optimizer):
    out = {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"grad:{n}": p.grad.clone() for n, p in model.named_parameters()})
    out.update({f"buffer:{n}": b.clone() for n, b in model.named_buffers()})
    for i, state in enumerate(optimizer.state.values()):
        out.update({f"optim:{i}:{k}": v.clone() for k, v in state.items()})
    return out


def assert_bit_exact(before, model, optimizer):
    after = snapshot(model, optimizer)
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_sleep_wake_restores_params_grads_buffers_and_optimizer_state_bit_exactly(disk_dir, target):
    model, optimizer = trained_actor()
    before = snapshot(model, optimizer)
    config = OffloadConfig(
        offload_train=True, offload_train_target=target, offload_train_disk_dir=disk_dir, offload_train_disk_chunk_mb=1
    )
    weight = model.lm.head.weight
    with RankDir(disk_dir, job="t", rank=0) as rank_dir:
        offloader = actor.build_offloader(config, rank_dir).track(model, optimizer)
        assert offloader.backend == "portable"
        for _ in range(3):
            with offloader.asleep():
                assert weight.untyped_storage().nbytes() == 0  # the memory went back
                assert offloader.resident_bytes() == 0
                if target == "disk":
                    assert os.listdir(os.path.join(rank_dir.path, "offload")) == ["actor.state"]
            assert_bit_exact(before, model, optimizer)
            assert model.lm.head.weight is weight  # the trainer's references stay valid
        offloader.close()
        if target == "disk":
            assert os.listdir(os.path.join(rank_dir.path, "offload")) == []
    assert os.listdir(disk_dir) == []


def test_training_continues_identically_after_cycles(disk_dir):
    """A step after sleep/wake equals the same step on a twin that never slept."""
    model, optimizer = trained_actor()
    twin, twin_optimizer = trained_actor()
    config = OffloadConfig(
        offload_train=True, offload_train_target="disk", offload_train_disk_dir=disk_dir, offload_train_disk_chunk_mb=1
    )
    tokens = torch.randint(0, 12, (4, 10), generator=torch.Generator().manual_seed(1))
    with RankDir(disk_dir, job="t") as rank_dir, actor.build_offloader(config, rank_dir) as offloader:
        offloader.track(model, optimizer)
        for _ in range(2):
            offloader.sleep()
            offloader.wake()
            for m, opt in ((model, optimizer), (twin, twin_optimizer)):
                opt.zero_grad(set_to_none=False)
                m(tokens).square().mean().backward()
                opt.step()
    assert_bit_exact(snapshot(twin, twin_optimizer), model, optimizer)


def test_state_that_appears_later_gets_its_own_slots_in_the_file(disk_dir):
    model = Actor()
    optimizer = torch.optim.AdamW(model.parameters())
    config = OffloadConfig(offload_train=True, offload_train_target="disk", offload_train_disk_dir=disk_dir)
    with RankDir(disk_dir, job="t") as rank_dir, actor.build_offloader(config, rank_dir, scope="tracked") as off:
        off.track(model, optimizer)
        first = off.sleep().nbytes
        off.wake()
        model(torch.randint(0, 12, (2, 10))).sum().backward()
        optimizer.step()  # grads and Adam moments appear
        model(torch.randint(0, 12, (2, 10))).sum().backward()  # grads live again
        before = snapshot(model, optimizer)
        second = off.sleep().nbytes
        off.wake()
        assert second > 3 * first
        assert_bit_exact(before, model, optimizer)


def test_offload_off_is_a_resident_no_op():
    model, optimizer = trained_actor()
    offloader = actor.build_offloader(OffloadConfig()).track(model, optimizer)
    assert offloader.backend == "none"
    with offloader.asleep():
        assert model.lm.head.weight.untyped_storage().nbytes() > 0
    assert offloader.last_sleep.nbytes == 0


def _run_child(code: str, **kwargs):
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "runtime")}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE, text=True, **kwargs
    )


def test_disk_target_keeps_host_memory_within_the_chunk(disk_dir):
    """256 MiB of actor state asleep on disk through a 8 MiB chunk: the process gives
    the state's memory back, and the peak while sleeping or waking stays within the
    state plus the chunk plus slack (no host copy of the state is ever made)."""
    child = _run_child(f"""
        import torch
        from greenroom import OffloadConfig, actor
        from greenroom.actor.memory import RssSampler
        from greenroom.dirs.rankdir import RankDir
        MIB = 1 << 20
        tensors = [torch.ones(64 * MIB // 4) for _ in range(4)]  # 256 MiB, touched
        sampler = RssSampler(0.001)
        config = OffloadConfig(offload_train=True, offload_train_target="disk",
                               offload_train_disk_dir={disk_dir!r}, offload_train_disk_chunk_mb=8)
        with RankDir({disk_dir!r}, job="mem") as rd, actor.build_offloader(config, rd) as off:
            off.track(tensors)
            off.sleep(); off.wake()  # first cycle builds the file
            awake = sampler.reset_peak()
            off.sleep()
            asleep = sampler.rss()
            off.wake()
            peak = sampler.reset_peak()
            assert all(bool((t == 1).all()) for t in tensors)
        print(awake // MIB, asleep // MIB, peak // MIB)
    """)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0
    awake, asleep, peak = map(int, out.split())
    assert asleep <= awake - 200, (awake, asleep)  # the 256 MiB left the process
    assert peak <= awake + 8 + 64, (awake, peak)  # chunk plus slack, never a second copy


def test_files_are_reclaimed_after_sigterm_while_asleep(disk_dir):
    child = _run_child(f"""
        import time, torch
        from greenroom import OffloadConfig, actor
        from greenroom.dirs.rankdir import RankDir
        config = OffloadConfig(offload_train=True, offload_train_target="disk", offload_train_disk_dir={disk_dir!r})
        rd = RankDir({disk_dir!r}, job="sig").open()
        off = actor.build_offloader(config, rd).track([torch.randn(1 << 20)])
        off.sleep()
        print(rd.path, flush=True)
        for _ in range(1200):  # short sleeps: a SIGTERM due just before one waits for it (tests/rank_holder.py)
            time.sleep(0.05)
    """)
    path = child.stdout.readline().strip()
    assert os.path.isfile(os.path.join(path, "offload", "actor.state"))
    child.send_signal(signal.SIGTERM)
    child.wait(timeout=30)
    assert child.returncode == 128 + signal.SIGTERM
    assert not os.path.exists(path)
    assert os.listdir(disk_dir) == []
