"""Megatron-core streaming on CUDA: bit-identical to the stock DistributedOptimizer.

Runs on the GPU machine (``pytest -m gpu tests/megatron/test_gpu.py``): one NCCL rank,
TP=PP=DP=1, a small GPTModel from the local layer spec with bf16 params plus one
native-fp32 param. The stock run and the streaming run see the same weights and data;
after every step their params, fp32 mains and both Adam moments are compared with
``torch.equal``, including across a save/load of the streaming run in the middle.
"""

import logging
import os
import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA: megatron-core's DDP and GPT forward run only on the GPU machine", allow_module_level=True)
pytest.importorskip("megatron.core", reason="megatron-core is not installed")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.optimizer import get_megatron_optimizer

from greenroom.config import OffloadConfig  # noqa: E402 (after the skips: megatron-core may be missing)
from greenroom.dirs.rankdir import RankDir  # noqa: E402 (after the skips: megatron-core may be missing)
from greenroom.errors import CheckpointError  # noqa: E402 (after the skips: megatron-core may be missing)
from greenroom.megatron import close, demo, load_checkpoint, save_checkpoint, streaming, streaming_members  # noqa: E402 (after the skips: megatron-core may be missing)

SIZE = demo.ModelSize(hidden=256, layers=2, heads=4, vocab=1024, seq=64, batch=2)
# Smaller than the word embedding's shard (1024 x 256): that one is a bucket of its own,
# the rest group into several buckets.
BUCKET_NUMEL = 150_000
# The sidecar format: megatron's checkpoint carries the small state, the bucket files go beside it.
SIDECAR = {"distrib_optim_sharding_type": "greenroom_streamed"}


@pytest.fixture(scope="module", autouse=True)
def single_gpu_world():
    demo.init_single_gpu()


def _offload(disk_dir, **overrides):
    return OffloadConfig(stream_optimizer_state_to_disk=True, offload_train_disk_dir=disk_dir, **overrides)


def _stock():
    model = demo.build_model(SIZE)
    return model, get_megatron_optimizer(demo.optimizer_config(), [model])


def _streamed(config, rank_dir):
    model = demo.build_model(SIZE)
    with streaming(config, rank_dir, bucket_numel=BUCKET_NUMEL):
        optimizer = get_megatron_optimizer(demo.optimizer_config(), [model])
    return model, optimizer


def _assert_same(stock_model, stock_opt, model, optimizer):
    for (name, a), (_, b) in zip(stock_model.named_parameters(), model.named_parameters()):
        assert torch.equal(a, b), f"param {name} differs"
    for ref, member in zip(stock_opt.chained_optimizers, streaming_members(optimizer)):
        for i, entry in enumerate(member.shard_entries):
            main = ref.shard_fp32_from_float16_groups[entry.group][entry.index]
            state = ref.optimizer.state[main]
            master, exp_avg, exp_avg_sq = member.streamed_state(i)
            assert torch.equal(master, main.cpu()), f"fp32 main of {entry.name} differs"
            assert torch.equal(exp_avg, state["exp_avg"].cpu()), f"exp_avg of {entry.name} differs"
            assert torch.equal(exp_avg_sq, state["exp_avg_sq"].cpu()), f"exp_avg_sq of {entry.name} differs"
        for shards, ours in zip(ref.shard_fp32_groups, member.shard_fp32_groups):
            for a, b in zip(shards, ours):
                assert torch.equal(a, b)
                assert torch.equal(
                    ref.optimizer.state[a]["exp_avg_sq"], member.resident_optimizer.state[b]["exp_avg_sq"]
                )


def test_streaming_is_bit_identical_to_stock_across_a_save_and_load(disk_dir):
    config = _offload(disk_dir)
    stock_model, stock_opt = _stock()
    with RankDir(disk_dir, role="first") as first:
        model, optimizer = _streamed(config, first)
        member = streaming_members(optimizer)[0]
        assert len(member.store.buckets) >= 3
        assert max(e.numel for e in member.shard_entries) > BUCKET_NUMEL
        for step in range(3):
            assert demo.train_step(stock_model, stock_opt, SIZE, step) == demo.train_step(model, optimizer, SIZE, step)
            _assert_same(stock_model, stock_opt, model, optimizer)
        checkpoint = f"{disk_dir}/ckpt"
        save_checkpoint(optimizer, checkpoint)
        weights = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        plain_state = optimizer.state_dict()
        close(optimizer)
    del model, optimizer
    with RankDir(disk_dir, role="second") as second:
        model, optimizer = _streamed(config, second)
        model.load_state_dict(weights, strict=False)
        optimizer.load_state_dict(plain_state)
        load_checkpoint(optimizer, checkpoint)
        for step in range(3, 6):
            assert demo.train_step(stock_model, stock_opt, SIZE, step) == demo.train_step(model, optimizer, SIZE, step)
            _assert_same(stock_model, stock_opt, model, optimizer)
        close(optimizer)


def test_a_checkpoint_without_streamed_state_is_refused_unless_no_load_optim(disk_dir, caplog):
    stock_model, stock_opt = _stock()
    demo.train_step(stock_model, stock_opt, SIZE, 0)
    with RankDir(disk_dir, role="refuse") as rank_dir:
        model, optimizer = _streamed(_offload(disk_dir), rank_dir)
        with pytest.raises(CheckpointError, match="written without greenroom streaming"):
            optimizer.load_state_dict(stock_opt.state_dict())
        with pytest.raises(CheckpointError, match="no streamed optimizer state"):
            load_checkpoint(optimizer, f"{disk_dir}/stock-ckpt")
        with caplog.at_level(logging.WARNING, logger="greenroom"):
            load_checkpoint(optimizer, f"{disk_dir}/stock-ckpt", no_load_optim=True)
        assert [r.levelname for r in caplog.records if "fresh optimizer state" in r.getMessage()] == ["WARNING"]
        close(optimizer)


def test_moments_written_as_bf16_are_not_read_as_fp32(disk_dir):
    with RankDir(disk_dir, role="bf16") as rank_dir:
        model, optimizer = _streamed(_offload(disk_dir, stream_optimizer_state_moment_dtype="bf16"), rank_dir)
        demo.train_step(model, optimizer, SIZE, 0)
        save_checkpoint(optimizer, f"{disk_dir}/bf16-ckpt")
        close(optimizer)
    with RankDir(disk_dir, role="fp32") as rank_dir:
        model, optimizer = _streamed(_offload(disk_dir), rank_dir)
        with pytest.raises(CheckpointError, match="bf16"):
            load_checkpoint(optimizer, f"{disk_dir}/bf16-ckpt")
        close(optimizer)


def test_megatrons_checkpoint_flow_carries_the_small_state_and_resume_stays_bit_identical(disk_dir):
    from megatron.core import dist_checkpointing

    stock_model, stock_opt = _stock()
    config = _offload(disk_dir)
    checkpoint = f"{disk_dir}/dist-ckpt"
    with RankDir(disk_dir, role="dist-first") as first:
        model, optimizer = _streamed(config, first)
        for step in range(2):
            demo.train_step(stock_model, stock_opt, SIZE, step)
            demo.train_step(model, optimizer, SIZE, step)
        os.makedirs(checkpoint)
        # megatron's training loop checkpoints the model inside its DDP wrapper (its keys
        # carry no ``module.`` prefix), and loads it back the same way.
        model_sd = model.module.sharded_state_dict()
        small = optimizer.sharded_state_dict(model_sd, metadata=SIDECAR)
        dist_checkpointing.save({"model": model_sd, "optimizer": small}, checkpoint)
        save_checkpoint(optimizer, checkpoint)
        close(optimizer)
    del model, optimizer
    with RankDir(disk_dir, role="dist-second") as second:
        model, optimizer = _streamed(config, second)
        model_sd = model.module.sharded_state_dict()
        loaded = dist_checkpointing.load(
            {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=SIDECAR)},
            checkpoint,
        )
        model.module.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        load_checkpoint(optimizer, checkpoint)
        for step in range(2, 5):
            assert demo.train_step(stock_model, stock_opt, SIZE, step) == demo.train_step(model, optimizer, SIZE, step)
            _assert_same(stock_model, stock_opt, model, optimizer)
        close(optimizer)
