"""Megatron-core streaming: every unsupported combination is refused at setup, on the CPU.

megatron-core's DDP needs CUDA, so a real DistributedOptimizer is built only on the GPU
machine (tests/megatron/test_gpu.py). Here the configs are megatron's own dataclasses;
where a refusal needs a model chunk, a SimpleNamespace carrying a real
DistributedDataParallelConfig stands in for the DDP-wrapped chunk (the only attribute
the check reads), because the real one cannot be built without CUDA.
"""

import threading
import types
import warnings

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e .[megatron])")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import megatron.core.optimizer as mcore_optimizer
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

from greenroom.config import OffloadConfig
from greenroom.errors import GreenroomError
from greenroom.megatron import checks
from greenroom.megatron.block import streaming
from greenroom.megatron.class_swap import StreamingSettings
from greenroom.megatron.optimizer import StreamingDistributedOptimizer
from greenroom.optim import DEFAULT_BUCKET_NUMEL


def _config(**overrides) -> OptimizerConfig:
    settings = dict(optimizer="adam", bf16=True, use_distributed_optimizer=True, lr=1e-3)
    late = {k: overrides.pop(k) for k in ("use_precision_aware_optimizer",) if k in overrides}
    settings.update(overrides)
    config = OptimizerConfig(**settings)
    # megatron 0.16 checks the Transformer Engine version when the precision-aware
    # optimizer is set at construction; set it afterwards, as a run with TE would have it.
    for key, value in late.items():
        setattr(config, key, value)
    return config


def _offload(disk_dir, **overrides) -> OffloadConfig:
    return OffloadConfig(stream_optimizer_state_to_disk=True, offload_train_disk_dir=disk_dir, **overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            dict(use_distributed_optimizer=False),
            "needs megatron's DistributedOptimizer: set OptimizerConfig.use_distributed_optimizer=True",
        ),
        (dict(optimizer="sgd"), "supports Adam only, got OptimizerConfig.optimizer='sgd'"),
        (dict(optimizer_cpu_offload=True), "drop --optimizer-cpu-offload"),
        (dict(use_precision_aware_optimizer=True), "drop --use-precision-aware-optimizer"),
        (dict(decoupled_weight_decay=False, weight_decay=0.1), "set OptimizerConfig.decoupled_weight_decay=True"),
    ],
)
def test_optimizer_config_refusals_name_the_setting(overrides, message):
    with pytest.raises(ValueError, match="^optimizer streaming") as info:
        checks.check_optimizer_config(_config(**overrides))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_weight_decay_schedule_on_a_coupled_adam_is_refused_at_the_step():
    """The build refuses coupled decay with weight_decay > 0; megatron's schedule sets a
    group's weight_decay after it, and the streamed update (AdamW's) applied it decoupled
    without a word. ``check_step_decay`` runs at every step, before anything changes."""
    import torch

    inner = torch.optim.Adam([torch.nn.Parameter(torch.zeros(4))], weight_decay=0.0)
    checks.check_step_decay(inner)
    inner.param_groups[0]["weight_decay"] = 0.05  # what OptimizerParamScheduler.step does
    with pytest.raises(ValueError, match="group 0 of megatron's Adam has coupled weight decay 0.05") as info:
        checks.check_step_decay(inner)
    assert "set OptimizerConfig.decoupled_weight_decay=True" in str(info.value) and "\n" not in str(info.value)
    checks.check_step_decay(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))], weight_decay=0.05))
    checks.check_step_decay(None)


def test_a_plain_adam_config_passes():
    checks.check_optimizer_config(_config())
    checks.check_optimizer_config(_config(decoupled_weight_decay=False, weight_decay=0.0))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(use_megatron_fsdp=True), "does not support Megatron FSDP"),
        (dict(fp8_param_gather=True), "does not support fp8 params"),
        (dict(use_distributed_optimizer=False), "set DistributedDataParallelConfig.use_distributed_optimizer=True"),
    ],
)
def test_ddp_config_refusals_name_the_setting(overrides, message):
    with pytest.raises(ValueError, match=message) as info:
        checks.check_ddp_config(DistributedDataParallelConfig(**overrides))
    assert "\n" not in str(info.value)


def test_fp8_params_on_the_transformer_config_are_refused():
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    checks.check_transformer_config(config)
    # Set afterwards, as a run with Transformer Engine's fp8 would have it (construction
    # with fp8_param checks for TE, which is not installed here).
    config.fp8_param = True
    with pytest.raises(ValueError, match="does not support fp8 params"):
        checks.check_transformer_config(config)


def test_streaming_block_needs_the_streaming_flag(disk_dir):
    with pytest.raises(ValueError, match="needs --stream-optimizer-state-to-disk"):
        with streaming(OffloadConfig(), rank_dir=None):
            pass


def test_streaming_block_swaps_megatrons_class_only_while_it_lasts(disk_dir):
    stock = mcore_optimizer.DistributedOptimizer
    with streaming(_offload(disk_dir), rank_dir=None) as settings:
        assert mcore_optimizer.DistributedOptimizer is StreamingDistributedOptimizer
        assert issubclass(StreamingDistributedOptimizer, stock)
        assert settings.bucket_numel == DEFAULT_BUCKET_NUMEL == 100_000_000
    assert mcore_optimizer.DistributedOptimizer is stock


def test_the_swap_is_undone_when_megatrons_construction_raises(disk_dir, tmp_path):
    """megatron's own get_megatron_optimizer on the CPU (gloo, one rank) reaches the
    streaming class through the swapped name, which refuses the config."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.optimizer import get_megatron_optimizer

    stock = mcore_optimizer.DistributedOptimizer
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        chunk = torch.nn.Linear(4, 4).to(torch.bfloat16)
        chunk.ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
        with pytest.raises(ValueError, match="supports Adam only"):
            with streaming(_offload(disk_dir), rank_dir=None):
                get_megatron_optimizer(_config(optimizer="sgd"), [chunk])
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    assert mcore_optimizer.DistributedOptimizer is stock


def test_blocks_in_two_threads_run_one_after_the_other(disk_dir):
    """Without the lock the second block would save the streaming class and restore it
    after the first ended, leaving megatron patched for good."""
    stock = mcore_optimizer.DistributedOptimizer
    events, inside, leave = [], threading.Event(), threading.Event()

    def block(name, hold):
        with streaming(_offload(disk_dir), rank_dir=None):
            events.append(f"{name} in")
            if hold:
                inside.set()
                leave.wait()
            events.append(f"{name} out")

    first = threading.Thread(target=block, args=("first", True), daemon=True)
    first.start()
    inside.wait()
    second = threading.Thread(target=block, args=("second", False), daemon=True)
    second.start()
    try:
        second.join(timeout=0.5)  # time for the second to race; what follows holds at any speed
        assert second.is_alive() and events == ["first in"]
        # Meanwhile megatron builds the streaming class in every thread; here it has no settings.
        with pytest.raises(GreenroomError, match="another thread is inside a streaming.. block"):
            mcore_optimizer.DistributedOptimizer(None, _config(), None, None, model_chunks=[])
    finally:
        leave.set()
        first.join()
        second.join()
    assert events == ["first in", "first out", "second in", "second out"]
    assert mcore_optimizer.DistributedOptimizer is stock


@pytest.mark.parametrize(
    ("config", "chunk", "message"),
    [
        (dict(optimizer="sgd"), dict(), "supports Adam only"),
        (dict(optimizer_cpu_offload=True), dict(), "CPU optimizer offload"),
        (dict(use_precision_aware_optimizer=True), dict(), "precision-aware optimizer"),
        (dict(), dict(use_megatron_fsdp=True), "Megatron FSDP"),
        (dict(), dict(fp8_param_gather=True), "fp8 params"),
    ],
)
def test_construction_refuses_before_allocating_anything(disk_dir, config, chunk, message):
    model_chunk = types.SimpleNamespace(
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True, **chunk)
    )
    with streaming(_offload(disk_dir), rank_dir=None):
        with pytest.raises(ValueError, match=message):
            StreamingDistributedOptimizer(
                None,
                _config(**config),
                None,
                None,
                model_chunks=[model_chunk],
                per_model_buffers=None,
                data_parallel_group=None,
                data_parallel_group_gloo=None,
                data_parallel_group_idx=0,
                distributed_optimizer_instance_id=0,
            )


def test_construction_outside_the_block_says_how():
    with pytest.raises(RuntimeError, match="through greenroom.megatron.streaming"):
        StreamingDistributedOptimizer(None, _config(), None, None, model_chunks=[])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bucket_numel_must_be_a_positive_integer(disk_dir, bad):
    with pytest.raises(ValueError, match="bucket_numel must be a positive integer"):
        StreamingSettings(config=_offload(disk_dir), rank_dir=None, bucket_numel=bad)


def test_an_inner_optimizer_other_than_torch_adam_is_refused():
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(
        ValueError, match="supports torch's Adam/AdamW, the DistributedOptimizer wraps torch.optim.sgd.SGD"
    ):
        checks.check_inner_optimizer(sgd)
    checks.check_inner_optimizer(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))]))
    checks.check_inner_optimizer(None)
