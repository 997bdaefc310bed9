"""Megatron-core's ``fully_reshardable`` and ``dp_reshardable`` checkpoints between the
stock and the streaming DistributedOptimizer, on one GPU
(``pytest -m gpu tests/megatron/test_gpu_dist_ckpt.py``).

The setup is ``test_gpu.py``'s (one NCCL rank, TP=PP=DP=1, a small bf16 GPTModel with
one native-fp32 param). Checkpoints go through ``dist_checkpointing.save``/``load`` with
``metadata={'distrib_optim_sharding_type': <each of the two>}``, the model inside its
DDP wrapper as megatron's training loop checkpoints it. Each resume is compared with
``torch.equal`` (params, fp32 mains, both moments, the native-fp32 shard and its Adam
state) right after the load and after each of three more steps:

- a stock checkpoint resumed under streaming, against stock's own load of it and then,
  step by step, against the stock run that saved it going on (stock's own resume steps
  differently: ``_shared_step`` says why);
- a streamed checkpoint resumed under stock against stock's resume of a stock
  checkpoint saved at the same step, step by step, and streaming's resume of its own
  against the run that saved it going on;
- moments streamed as bf16: stock reads the fp32 values the bf16 bytes denote, a run
  streaming fp32 moments refuses the checkpoint in one line and stays as it was, and a
  run streaming bf16 resumes it;
- an async save through megatron's ``AsyncCallsQueue``, with three steps run before it is
  finalized, holds the state it was scheduled with.

The streamed runs' bucket files are compressed (``auto``: nvCOMP), so a save decodes them;
the streamed save and the async one also run through ``StreamedSaveStrategy``, which
writes the decoded state once (``decode_in_save``).
"""

import inspect
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
    from megatron.core import dist_checkpointing

from greenroom.dirs.rankdir import RankDir  # noqa: E402 (after the skips: megatron-core may be missing)
from greenroom.errors import CheckpointError  # noqa: E402 (after the skips: megatron-core may be missing)
from greenroom.megatron import (  # noqa: E402 (after the skips: megatron-core may be missing)
    DECODE_IN_SAVE,
    StreamedSaveStrategy,
    close,
    demo,
    streaming_members,
)
from tests.megatron.test_gpu import SIZE, _assert_same, _offload, _stock, _streamed  # noqa: E402 (after the skips)

KINDS = ["fully_reshardable", "dp_reshardable"]
MORE_STEPS = range(3, 6)


@pytest.fixture(scope="module", autouse=True)
def single_gpu_world():
    demo.init_single_gpu()


def _train(model, optimizer, steps) -> list[float]:
    return [demo.train_step(model, optimizer, SIZE, step) for step in steps]


def _metadata(kind: str, decode_in_save: bool = False) -> dict:
    return {"distrib_optim_sharding_type": kind, DECODE_IN_SAVE: decode_in_save}


def _save(model, optimizer, checkpoint: str, kind: str, decode_in_save: bool = False) -> None:
    os.makedirs(checkpoint)
    model_sd = model.module.sharded_state_dict()
    metadata = _metadata(kind, decode_in_save)
    state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, metadata=metadata)}
    dist_checkpointing.save(state, checkpoint, sharded_strategy=StreamedSaveStrategy() if decode_in_save else None)
    if decode_in_save:  # the streamed state went to greenroom's files of the checkpoint
        assert any("_greenroom" in name for name in os.listdir(checkpoint)), os.listdir(checkpoint)


def _load(model, optimizer, checkpoint: str, kind: str) -> None:
    model_sd = model.module.sharded_state_dict()
    template = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=_metadata(kind)),
    }
    loaded = dist_checkpointing.load(template, checkpoint)
    model.module.load_state_dict(loaded["model"])
    # Stock's load copies into its native-fp32 shards, which (megatron-core 0.16.1 and
    # 0.19.2) are views of params that require grad, not detached: autograd refuses that
    # copy outside no_grad, so the load runs under it, stock's and streaming's alike.
    with torch.no_grad():
        optimizer.load_state_dict(loaded["optimizer"])


def _stock_resumed(checkpoint: str, kind: str):
    """A fresh stock model and optimizer loaded from ``checkpoint``. Stock's
    ``sharded_state_dict`` begins with ``state_dict()``, which (megatron-core 0.16.1 and
    0.19.2, distrib_optimizer.py) asserts one step value among its inner Adam's
    per-param states, and a torch Adam that never stepped has none; so it takes one
    step first, whose every effect (weights, mains, moments, step) the load replaces."""
    model, optimizer = _stock()
    demo.train_step(model, optimizer, SIZE, 0)
    if kind == "fully_reshardable":
        _keep_torch_adams_step(optimizer)
    _load(model, optimizer, checkpoint, kind)
    return model, optimizer


def _keep_torch_adams_step(optimizer) -> None:
    """Stock megatron-core (0.16.1 and 0.19.2) cannot load a ``fully_reshardable``
    checkpoint into torch's Adam, the inner optimizer it uses where neither Transformer
    Engine nor Apex is installed (as on the GPU machine): its
    ``_set_main_param_and_optimizer_states`` copies a checkpoint tensor into every
    tensor of the inner state, torch's Adam keeps ``step`` there as a tensor, and the
    format never saves one (``load_parameter_state_from_fully_reshardable`` skips it),
    so the lookup raises ``KeyError: 'step'``. The step itself is restored from the
    param groups by ``load_state_dict`` before that call, so the stock reference here
    hands that call the step it already holds: the one change to stock in these tests."""
    for member in optimizer.chained_optimizers:
        set_states = member._set_main_param_and_optimizer_states

        def with_step(model_param, tensors, _member=member, _set=set_states):
            group, order = _member.model_param_group_index_map[model_param]
            state = _member.optimizer.state[_member.optimizer.param_groups[group]["params"][order]]
            if isinstance(state.get("step"), torch.Tensor) and "step" not in tensors:
                tensors = {**tensors, "step": state["step"].clone()}
            return _set(model_param, tensors)

        member._set_main_param_and_optimizer_states = with_step


def _assert_stock_same(a_model, a_opt, b_model, b_opt) -> None:
    """Two stock runs hold the same params, mains, moments and steps."""
    for (name, a), (_, b) in zip(a_model.named_parameters(), b_model.named_parameters()):
        assert torch.equal(a, b), f"param {name} differs"
    for a, b in zip(a_opt.chained_optimizers, b_opt.chained_optimizers):
        for groups in ("shard_fp32_from_float16_groups", "shard_fp32_groups"):
            for ga, gb in zip(getattr(a, groups), getattr(b, groups)):
                for pa, pb in zip(ga, gb):
                    assert torch.equal(pa, pb), f"{groups} differs"
                    sa, sb = a.optimizer.state[pa], b.optimizer.state[pb]
                    for key in ("exp_avg", "exp_avg_sq", "step"):
                        assert torch.equal(sa[key].cpu(), sb[key].cpu()), f"{groups} {key} differs"


def _shared_step(optimizer) -> bool:
    """Whether a stock optimizer's inner torch Adam holds one ``step`` tensor for all its
    params: what stock's ``load_state_dict`` (megatron-core 0.16.1 and 0.19.2, without
    Transformer Engine or Apex) gives it. torch's Adam then adds 1 to that one tensor once
    per param at each step, so a stock resume steps with another bias correction than the
    run that saved; these tests compare the streaming resume with that run, going on."""
    return all(
        len({id(state["step"]) for state in member.optimizer.state.values()}) == 1
        for member in optimizer.chained_optimizers
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_stock_checkpoint_resumes_under_streaming_as_the_stock_run_goes_on(disk_dir, kind):
    checkpoint = f"{disk_dir}/stock-ckpt"
    saver_model, saver_opt = _stock()
    _train(saver_model, saver_opt, range(3))
    _save(saver_model, saver_opt, checkpoint, kind)
    stock_model, stock_opt = _stock_resumed(checkpoint, kind)
    assert _shared_step(stock_opt)
    with RankDir(disk_dir, role="from-stock") as rank_dir:
        model, optimizer = _streamed(_offload(disk_dir), rank_dir)
        _load(model, optimizer, checkpoint, kind)
        _assert_same(stock_model, stock_opt, model, optimizer)  # what stock's own load holds
        _assert_same(saver_model, saver_opt, model, optimizer)
        for step in MORE_STEPS:
            assert _train(saver_model, saver_opt, [step]) == _train(model, optimizer, [step])
            _assert_same(saver_model, saver_opt, model, optimizer)
        close(optimizer)


@pytest.mark.parametrize("decode_in_save", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_a_streamed_checkpoint_resumes_under_stock_as_stocks_own_checkpoint_does(disk_dir, kind, decode_in_save):
    stock_ckpt, streamed_ckpt = f"{disk_dir}/stock-ckpt", f"{disk_dir}/streamed-ckpt"
    saver_model, saver_opt = _stock()
    with RankDir(disk_dir, role="saver") as rank_dir:
        model, optimizer = _streamed(_offload(disk_dir), rank_dir)
        assert _train(saver_model, saver_opt, range(3)) == _train(model, optimizer, range(3))
        _assert_same(saver_model, saver_opt, model, optimizer)
        _save(saver_model, saver_opt, stock_ckpt, kind)
        _save(model, optimizer, streamed_ckpt, kind, decode_in_save)
        close(optimizer)
    del model, optimizer
    common = dist_checkpointing.load_common_state_dict(streamed_ckpt)["optimizer"]
    assert common["param_state_sharding_type"] == kind
    assert common["greenroom"]["moment_dtype"] == "fp32"
    own_model, own_opt = _stock_resumed(stock_ckpt, kind)
    from_streamed_model, from_streamed_opt = _stock_resumed(streamed_ckpt, kind)
    with RankDir(disk_dir, role="resumer") as rank_dir:
        model, optimizer = _streamed(_offload(disk_dir), rank_dir)
        _load(model, optimizer, streamed_ckpt, kind)
        _assert_stock_same(own_model, own_opt, from_streamed_model, from_streamed_opt)
        _assert_same(own_model, own_opt, model, optimizer)
        for step in MORE_STEPS:
            # stock reads the streamed checkpoint as it reads its own, step for step
            assert _train(own_model, own_opt, [step]) == _train(from_streamed_model, from_streamed_opt, [step])
            _assert_stock_same(own_model, own_opt, from_streamed_model, from_streamed_opt)
            # streaming goes on as the run that saved does
            assert _train(saver_model, saver_opt, [step]) == _train(model, optimizer, [step])
            _assert_same(saver_model, saver_opt, model, optimizer)
        close(optimizer)


def _first_fp32(member) -> tuple[int, int]:
    """(group, index) of the first native-fp32 shard (the model's ``aux_fp32``, in
    whichever group megatron's param grouping puts it)."""
    return next((g, j) for g, shards in enumerate(member.shard_fp32_groups) for j in range(len(shards)))


def _entry_states(optimizer) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    member = streaming_members(optimizer)[0]
    return [member.streamed_state(i) for i in range(len(member.shard_entries))]


@pytest.mark.parametrize("kind", KINDS)
def test_moments_streamed_as_bf16_load_into_stock_as_their_fp32_values_and_are_refused_by_an_fp32_run(disk_dir, kind):
    checkpoint = f"{disk_dir}/bf16-ckpt"
    bf16 = _offload(disk_dir, stream_optimizer_state_moment_dtype="bf16")
    with RankDir(disk_dir, role="bf16-saver") as rank_dir:
        model, optimizer = _streamed(bf16, rank_dir)
        _train(model, optimizer, range(3))
        saved = _entry_states(optimizer)
        member = streaming_members(optimizer)[0]
        entries = member.shard_entries
        g, j = _first_fp32(member)
        saved_resident = {
            k: v.clone() for k, v in member.resident_optimizer.state[member.shard_fp32_groups[g][j]].items()
        }
        _save(model, optimizer, checkpoint, kind)
        close(optimizer)
    assert dist_checkpointing.load_common_state_dict(checkpoint)["optimizer"]["greenroom"]["moment_dtype"] == "bf16"
    for _, exp_avg, exp_avg_sq in saved:  # the decoded values are bf16 values, and not all zero
        assert torch.equal(exp_avg, exp_avg.bfloat16().float()) and bool(exp_avg.any())
        assert torch.equal(exp_avg_sq, exp_avg_sq.bfloat16().float()) and bool(exp_avg_sq.any())

    # stock reads the fp32 values the bf16 bytes denote
    stock_model, stock_opt = _stock_resumed(checkpoint, kind)
    ref = stock_opt.chained_optimizers[0]
    for entry, (master, exp_avg, exp_avg_sq) in zip(entries, saved):
        main = ref.shard_fp32_from_float16_groups[entry.group][entry.index]
        assert torch.equal(main.cpu(), master), entry.name
        assert torch.equal(ref.optimizer.state[main]["exp_avg"].cpu(), exp_avg), entry.name
        assert torch.equal(ref.optimizer.state[main]["exp_avg_sq"].cpu(), exp_avg_sq), entry.name
    assert _first_fp32(ref) == (g, j)
    fp32_state = ref.optimizer.state[ref.shard_fp32_groups[g][j]]
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(fp32_state[key], saved_resident[key]), key

    # a run streaming fp32 moments refuses it, in one line naming the flag, and is unchanged
    with RankDir(disk_dir, role="fp32-run") as rank_dir:
        model, optimizer = _streamed(_offload(disk_dir), rank_dir)
        before = _entry_states(optimizer)
        with pytest.raises(CheckpointError) as e:
            _load(model, optimizer, checkpoint, kind)
        message = str(e.value)
        assert "\n" not in message and message.endswith("--stream-optimizer-state-moment-dtype bf16"), message
        for a, b in zip(before, _entry_states(optimizer)):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        _train(model, optimizer, [0])  # not poisoned: a refused load changed nothing
        close(optimizer)

    # a run streaming bf16 moments resumes it as saved
    with RankDir(disk_dir, role="bf16-run") as rank_dir:
        model, optimizer = _streamed(bf16, rank_dir)
        _load(model, optimizer, checkpoint, kind)
        for a, b in zip(saved, _entry_states(optimizer)):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        close(optimizer)


# megatron-core 0.19's async default is the NVIDIA Resiliency Extension's writer, which needs
# nvidia-resiliency-ext 0.6.0 or later: no package index our machines reach serves it.
# megatron-core's own writer (the only one in 0.16) is what runs here.
_MCORE_ASYNC = (
    {"async_strategy": "mcore"} if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters else {}
)


@pytest.mark.parametrize("decode_in_save", [False, True])
def test_an_async_save_holds_the_state_it_was_scheduled_with_while_the_next_steps_run(disk_dir, decode_in_save):
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    checkpoint = f"{disk_dir}/async-ckpt"
    os.makedirs(checkpoint)
    queue = AsyncCallsQueue()
    with RankDir(disk_dir, role="async-saver") as rank_dir:
        model, optimizer = _streamed(_offload(disk_dir), rank_dir)
        _train(model, optimizer, range(3))
        saved = _entry_states(optimizer)
        saved_params = [p.detach().clone() for p in model.parameters()]
        model_sd = model.module.sharded_state_dict()
        metadata = _metadata("fully_reshardable", decode_in_save)
        state = {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, metadata=metadata)}
        # As megatron's training loop does: the tensors are staged when the request is
        # scheduled, and a forked writer writes them while training goes on.
        strategy = {"sharded_strategy": StreamedSaveStrategy()} if decode_in_save else {}
        queue.schedule_async_request(
            dist_checkpointing.save(state, checkpoint, async_sharded_save=True, **_MCORE_ASYNC, **strategy)
        )
        _train(model, optimizer, MORE_STEPS)
        assert not all(torch.equal(a[1], b[1]) for a, b in zip(saved, _entry_states(optimizer)))
        queue.maybe_finalize_async_calls(blocking=True)
        close(optimizer)
    with RankDir(disk_dir, role="async-loader") as rank_dir:
        model, optimizer = _streamed(_offload(disk_dir), rank_dir)
        _load(model, optimizer, checkpoint, "fully_reshardable")
        for a, b in zip(saved, _entry_states(optimizer)):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        for a, b in zip(saved_params, model.parameters()):
            assert torch.equal(a, b)
        close(optimizer)
