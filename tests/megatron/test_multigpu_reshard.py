"""A ``fully_reshardable`` checkpoint resumed at another TP/DP layout, on two GPUs
(``pytest -m multigpu tests/megatron/test_multigpu_reshard.py``).

Two NCCL ranks. At the saving layout, a stock and a streaming DistributedOptimizer train
three steps side by side (``torch.equal`` after each) and each saves through
``dist_checkpointing`` with ``metadata={'distrib_optim_sharding_type': 'fully_reshardable'}``.
At the loading layout (TP 2 <-> TP 1 x DP 2), stock megatron-core's own resharded load of
its own checkpoint is the reference: three other resumes must hold what it holds, bit
for bit, right after the load (stock from the streamed checkpoint, streaming from the
stock checkpoint, streaming from its own). Over three more steps stock from the
streamed checkpoint must step as stock from its own, and streaming from either
checkpoint alike (stock's resume steps with one step tensor shared by its params,
``test_gpu_dist_ckpt._shared_step``, so the two optimizers part there).

A PP change needs megatron's pipeline schedule in the training step, which the small
demo step does not run; the format's PP resharding is checked on gloo ranks by
``tests/megatron/test_mcore_format.py``.

These tests are skipped, saying they need a multi-GPU machine, unless ``-m`` names
``multigpu`` (tests/conftest.py), and then fail, not skip, on a machine with fewer than
two GPUs.
"""

import os
import warnings

import pytest
import torch

pytestmark = pytest.mark.multigpu

FULLY = {"distrib_optim_sharding_type": "fully_reshardable"}
WORLD = 2
# (TP at save, TP at load); DP is WORLD // TP.
LAYOUTS = [(2, 1), (1, 2)]


@pytest.fixture(autouse=True)
def two_gpus():
    if torch.cuda.device_count() < WORLD:
        pytest.fail(f"needs {WORLD} GPUs, this machine has {torch.cuda.device_count()}: run it on a multi-GPU machine")
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")


@pytest.mark.parametrize(("save_tp", "load_tp"), LAYOUTS, ids=["tp2-to-tp1dp2", "tp1dp2-to-tp2"])
def test_a_checkpoint_resumes_at_another_layout_as_stock_resumes_its_own(disk_dir, save_tp, load_tp):
    from tests.megatron.mcore_support import spawn_nccl

    spawn_nccl(_resharded_resume, WORLD, disk_dir, save_tp, load_tp)


def _resharded_resume(rank: int, world: int, disk_dir: str, save_tp: int, load_tp: int) -> None:
    from megatron.core import parallel_state

    from greenroom.dirs.rankdir import RankDir
    from greenroom.megatron import close, demo, streaming_members
    from tests.megatron.test_gpu import SIZE, _assert_same, _offload, _stock, _streamed
    from tests.megatron.test_gpu_dist_ckpt import _assert_stock_same, _load, _stock_resumed

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import dist_checkpointing

    def save(model, optimizer, checkpoint):
        model_sd = model.module.sharded_state_dict()
        state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, metadata=dict(FULLY))}
        dist_checkpointing.save(state, checkpoint)

    def load(model, optimizer, checkpoint):
        _load(model, optimizer, checkpoint, "fully_reshardable")

    def stock_resumed(checkpoint):
        return _stock_resumed(checkpoint, "fully_reshardable")

    def _assert_streaming_same(a_model, a_opt, b_model, b_opt):
        for (name, a), (_, b) in zip(a_model.named_parameters(), b_model.named_parameters()):
            assert torch.equal(a, b), f"param {name} differs"
        for a, b in zip(streaming_members(a_opt), streaming_members(b_opt)):
            for i in range(len(a.shard_entries)):
                assert all(torch.equal(x, y) for x, y in zip(a.streamed_state(i), b.streamed_state(i)))

    stock_ckpt, streamed_ckpt = f"{disk_dir}/stock-ckpt", f"{disk_dir}/streamed-ckpt"
    if rank == 0:
        os.makedirs(stock_ckpt)
        os.makedirs(streamed_ckpt)
    torch.distributed.barrier()

    parallel_state.initialize_model_parallel(save_tp, 1)
    stock_model, stock_opt = _stock()
    with RankDir(disk_dir, role="saver", rank=rank) as rank_dir:
        model, optimizer = _streamed(_offload(disk_dir), rank_dir)
        for step in range(3):
            assert demo.train_step(stock_model, stock_opt, SIZE, step) == demo.train_step(model, optimizer, SIZE, step)
            _assert_same(stock_model, stock_opt, model, optimizer)
        save(stock_model, stock_opt, stock_ckpt)
        save(model, optimizer, streamed_ckpt)
        close(optimizer)
    del stock_model, stock_opt, model, optimizer
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(load_tp, 1)
    assert parallel_state.get_data_parallel_world_size() == world // load_tp
    ref_model, ref_opt = stock_resumed(stock_ckpt)
    from_streamed_model, from_streamed_opt = stock_resumed(streamed_ckpt)
    with (
        RankDir(disk_dir, role="from-stock", rank=rank) as a_dir,
        RankDir(disk_dir, role="from-own", rank=rank) as b_dir,
    ):
        from_stock = _streamed(_offload(disk_dir), a_dir)
        from_own = _streamed(_offload(disk_dir), b_dir)
        load(*from_stock, stock_ckpt)
        load(*from_own, streamed_ckpt)
        # Right after the load all four hold what stock's resharded load of its own
        # checkpoint holds.
        _assert_stock_same(ref_model, ref_opt, from_streamed_model, from_streamed_opt)
        _assert_same(ref_model, ref_opt, *from_stock)
        _assert_same(ref_model, ref_opt, *from_own)
        # Then stock steps on with one step tensor shared by its params
        # (test_gpu_dist_ckpt._shared_step), streaming with the saved step: each pair
        # steps on alike, stock from either checkpoint, streaming from either.
        for step in (3, 4, 5):
            loss = demo.train_step(ref_model, ref_opt, SIZE, step)
            assert demo.train_step(from_streamed_model, from_streamed_opt, SIZE, step) == loss
            _assert_stock_same(ref_model, ref_opt, from_streamed_model, from_streamed_opt)
            assert demo.train_step(*from_stock, SIZE, step) == demo.train_step(*from_own, SIZE, step)
            _assert_streaming_same(*from_stock, *from_own)
        close(from_stock[1])
        close(from_own[1])
    parallel_state.destroy_model_parallel()
