"""StreamingAdam in fp32 is bit-identical to torch.optim.AdamW (foreach on the CPU)."""

import os

import pytest
import torch

from greenroom.config import OffloadConfig
from greenroom.dirs.rankdir import RankDir
from greenroom.optim import StreamingAdam
from greenroom.optim.store.layout import DEVICE_BUFFERS
from tests.optim.support import ODD_SHAPES, assert_state_equal, set_grads, step_beside_fp32_masters, twins


def _groups(params, split):
    return [
        {"params": params[:split]},
        {"params": params[split:], "lr": 3e-3, "weight_decay": 0.1, "betas": (0.8, 0.95)},
    ]


@pytest.mark.parametrize("bucket_numel", [1, 500, 1500, 10_000_000])
def test_fp32_bit_identical_over_steps_with_groups_and_missing_grads(disk_dir, bucket_numel):
    ours, ref_params = twins(ODD_SHAPES)
    opt = StreamingAdam(
        _groups(ours, 3), lr=1e-2, weight_decay=0.01, state_dir=disk_dir, bucket_numel=bucket_numel, resident_numel=0
    )
    ref = torch.optim.AdamW(_groups(ref_params, 3), lr=1e-2, weight_decay=0.01, foreach=True)
    if bucket_numel == 1:
        assert len(opt.store.buckets) == len(ODD_SHAPES)  # every param larger than the cap: its own bucket
    if bucket_numel == 1500:
        assert any(b.numel > 1500 for b in opt.store.buckets)  # (2049, 3) alone, over the cap
        assert any(len(b.entries) > 1 for b in opt.store.buckets)
    for step in range(6):
        set_grads(ours, ref_params, step=step, skip={1} if step % 2 else {4})
        opt.step()
        ref.step()
        assert_state_equal(opt, ref, ours, ref_params)
    opt.close()


def test_param_never_given_a_grad_is_untouched_and_has_no_state(disk_dir):
    ours, ref_params = twins(ODD_SHAPES[:3])
    # weight_decay given: AdamW's default is 0.01, StreamingAdam's (the issue's) 0.0
    opt = StreamingAdam(ours, weight_decay=0.01, state_dir=disk_dir, resident_numel=0, bucket_numel=100)
    ref = torch.optim.AdamW(ref_params, foreach=True)
    for step in range(3):
        set_grads(ours, ref_params, step=step, skip={2})
        opt.step()
        ref.step()
    assert ours[2] not in opt.state
    assert_state_equal(opt, ref, ours, ref_params)
    opt.close()


def test_lr_scheduler_closure_and_zero_grad_behave_as_adamw(disk_dir):
    ours, ref_params = twins(ODD_SHAPES)
    opt = StreamingAdam(ours, lr=0.05, weight_decay=0.02, state_dir=disk_dir, bucket_numel=2000, resident_numel=0)
    ref = torch.optim.AdamW(ref_params, lr=0.05, weight_decay=0.02, foreach=True)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=8) for o in (opt, ref)]
    target = [torch.ones(s) for s in ODD_SHAPES]
    for step in range(8):
        losses = []
        for o, params in ((opt, ours), (ref, ref_params)):

            def closure(params=params, o=o):
                o.zero_grad()
                loss = sum(((p - t) ** 2).sum() for p, t in zip(params, target))
                loss.backward()
                return loss

            losses.append(o.step(closure))
        assert torch.equal(losses[0], losses[1])
        for s in scheds:
            s.step()
        assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    assert_state_equal(opt, ref, ours, ref_params)
    opt.zero_grad()
    assert all(p.grad is None for p in ours)
    opt.close()


def test_tiny_fp32_params_stay_resident_and_stay_exact(disk_dir):
    shapes = [(256,), (4096, 32), (16,)]  # an expert_bias, a weight, an A_log
    ours, ref_params = twins(shapes)
    opt = StreamingAdam(ours, lr=1e-2, state_dir=disk_dir)  # AdamW's default weight decay, 0.01
    ref = torch.optim.AdamW(ref_params, lr=1e-2, foreach=True)
    assert [id(p) for p in opt.resident] == [id(ours[0]), id(ours[2])]
    assert [id(p) for p in opt.streamed] == [id(ours[1])]
    for step in range(4):
        set_grads(ours, ref_params, step=step)
        opt.step()
        ref.step()
    assert "exp_avg" in opt.state[ours[0]] and "exp_avg" not in opt.state[ours[1]]
    assert_state_equal(opt, ref, ours, ref_params)
    opt.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_params_match_an_fp32_master_reference(disk_dir, dtype):
    ours, _ = twins(ODD_SHAPES, dtype=dtype)
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]
    opt = StreamingAdam(ours, lr=1e-2, weight_decay=0.1, state_dir=disk_dir, bucket_numel=3000)
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, foreach=True)
    assert all(b.master is not None for b in opt.store.buckets)
    for step in range(5):
        step_beside_fp32_masters(opt, ref, ours, masters, step=step, dtype=dtype)
    files_masters = {}
    for state in opt.store.stream():
        for i, view in zip(state.bucket.entries, state.views(state.master)):
            files_masters[i] = view.clone()
    for i, m in enumerate(masters):
        assert torch.equal(files_masters[i], m.detach())
    opt.close()


def test_bytes_on_disk_follow_the_plan_counts(disk_dir):
    from greenroom.optim.footprint import streamed_bytes_per_param

    for dtype, master in ((torch.float32, False), (torch.bfloat16, True)):
        for moment in ("fp32", "bf16", "fp8e4m3"):
            p = torch.nn.Parameter(torch.zeros(1 << 20, dtype=dtype))
            path = os.path.join(disk_dir, f"{dtype}-{moment}")
            opt = StreamingAdam([p], state_dir=path, moment_dtype=moment)
            expected = streamed_bytes_per_param(moment, master_on_disk=master, remainder=master) * p.numel()
            assert opt.store.state_bytes == pytest.approx(expected, abs=3 * 4096)
            opt.close()


def test_from_config_uses_the_rank_dir_and_flags(disk_dir):
    config = OffloadConfig(
        stream_optimizer_state_to_disk=True,
        stream_optimizer_state_moment_dtype="bf16",
        offload_train_disk_dir=disk_dir,
        offload_train_disk_chunk_mb=8,
    )
    p = torch.nn.Parameter(torch.randn(100_000))
    with RankDir(disk_dir, rank=3, job="j") as rank_dir:
        opt = StreamingAdam.from_config([p], config, rank_dir, lr=0.1)
        assert opt.moment_dtype == "bf16" and opt.param_groups[0]["lr"] == 0.1
        assert os.listdir(rank_dir.subdir("optim")) == ["bucket-00000.bin"]
        opt.close()
    assert not os.path.exists(rank_dir.path)  # the files go with the rank dir
    with pytest.raises(ValueError, match="--stream-optimizer-state-to-disk"):
        StreamingAdam.from_config([p], OffloadConfig(), disk_dir)


def test_bad_hyperparameters_are_one_line_value_errors(disk_dir):
    p = torch.nn.Parameter(torch.randn(10))
    for kwargs, match in (
        ({"lr": -1.0}, "lr"),
        ({"betas": (0.9, 1.0)}, r"betas\[1\]"),
        ({"moment_dtype": "fp12"}, "fp12"),
        ({"bucket_numel": 0}, "bucket_numel"),
        ({"chunk_mb": 0}, "chunk_mb"),
    ):
        with pytest.raises(ValueError, match=match):
            StreamingAdam([p], state_dir=disk_dir, resident_numel=0, **kwargs)
    with pytest.raises(ValueError, match="int64"):
        StreamingAdam([torch.zeros(3, dtype=torch.int64)], state_dir=disk_dir)


def test_initialization_holds_one_bucket(disk_dir):
    params = [torch.nn.Parameter(torch.randn(10_000, dtype=torch.bfloat16)) for _ in range(8)]
    opt = StreamingAdam(params, state_dir=disk_dir, bucket_numel=20_000)
    assert len(opt.store.buckets) == 4
    # after init only one slot (one bucket file's bytes) exists, and the fp32 scratch a
    # bucket's masters are rebuilt in from their remainders: not the whole state
    assert opt.store.device_bytes() == opt.store.max_bucket_bytes + 4 * 20_000 < opt.store.state_bytes / 2
    opt.close()


def test_a_step_holds_three_buffers_and_reads_ahead_past_the_last_write_back(disk_dir):
    # Three bucket buffers (optim.store.layout.DEVICE_BUFFERS): the read of bucket k waits for
    # the write-back of bucket k-3 only, never for that of k-2 (which may still be draining).
    params = [torch.nn.Parameter(torch.randn(10_000)) for _ in range(5)]
    opt = StreamingAdam(params, state_dir=disk_dir, bucket_numel=10_000, resident_numel=0)
    store = opt.store
    assert DEVICE_BUFFERS == 3 and len(store.buckets) == 5
    events = []
    stream = store.bucket_stream
    submit_read, submit_write = stream._submit_read, stream._submit_write

    def read(index, buffer):
        events.append(("read", index))
        return submit_read(index, buffer)

    def write(index, buffer, checkpoint, fresh):
        submit_write(index, buffer, checkpoint, fresh)
        transfer = buffer.write

        class Waited:
            def wait(self):
                events.append(("waited", index))
                return transfer.wait()

        buffer.write = Waited()

    stream._submit_read, stream._submit_write = read, write
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert [e for e in events if e[0] == "read"] == [("read", k) for k in range(5)]
    assert not any(e[0] == "waited" for e in events[: events.index(("read", 2))])  # three reads before any wait
    for k in range(3, 5):
        before = events[: events.index(("read", k))]
        assert ("waited", k - 3) in before and ("waited", k - 2) not in before, events
    assert store.device_bytes() == 3 * store.max_bucket_bytes
    opt.close()


def test_a_store_of_two_buckets_holds_two_buffers(disk_dir):
    params = [torch.nn.Parameter(torch.randn(10_000)) for _ in range(2)]
    opt = StreamingAdam(params, state_dir=disk_dir, bucket_numel=10_000, resident_numel=0)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert opt.store.device_bytes() == 2 * opt.store.max_bucket_bytes
    opt.close()


def test_released_device_buffers_come_back_and_the_steps_stay_exact(disk_dir):
    # What a sleeping actor does between steps: give the store's slots and scratch back.
    ours, ref_params = twins(ODD_SHAPES)
    opt = StreamingAdam(ours, lr=1e-2, weight_decay=0.01, state_dir=disk_dir, bucket_numel=1500, resident_numel=0)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.01, foreach=True)
    for step in range(3):
        opt.store.release_device_buffers()
        assert opt.store.device_bytes() == 0
        set_grads(ours, ref_params, step=step)
        opt.step()
        ref.step()
        assert_state_equal(opt, ref, ours, ref_params)
    opt.close()
