"""What streaming supports on megatron-core, checked at setup with one line per refusal.

Streaming replaces the DistributedOptimizer's fp32 main shards and Adam moments; every
combination below either keeps that state somewhere else (CPU offload, the
precision-aware optimizer, Megatron FSDP), holds params in a form the bucket files do
not describe (fp8/fp4 params), or is not the Adam update the engine computes.

The checks read config attributes with ``getattr`` so that they work on every
megatron-core release we support (0.16 on Python 3.11, 0.17+ on 3.12), where fields
were added over time.
"""

from __future__ import annotations

from greenroom.errors import ConfigError


def check_optimizer_config(config) -> None:
    """Refuse an ``OptimizerConfig`` that streaming cannot serve (``ValueError``)."""
    if not getattr(config, "use_distributed_optimizer", False):
        raise ConfigError(
            "optimizer streaming needs megatron's DistributedOptimizer: set "
            "OptimizerConfig.use_distributed_optimizer=True (--use-distributed-optimizer)"
        )
    if getattr(config, "use_layer_wise_distributed_optimizer", False):
        raise ConfigError(
            "optimizer streaming does not support the layer-wise distributed optimizer: "
            "set use_layer_wise_distributed_optimizer=False"
        )
    if getattr(config, "optimizer", "adam") != "adam":
        raise ConfigError(
            f"optimizer streaming supports Adam only, got OptimizerConfig.optimizer="
            f"{config.optimizer!r}: use --optimizer adam or turn streaming off"
        )
    if not getattr(config, "decoupled_weight_decay", True) and getattr(config, "weight_decay", 0.0) != 0.0:
        raise ConfigError(
            "optimizer streaming computes AdamW (decoupled weight decay): set "
            "OptimizerConfig.decoupled_weight_decay=True or weight_decay=0"
        )
    if getattr(config, "optimizer_cpu_offload", False):
        raise ConfigError(
            "optimizer streaming and CPU optimizer offload both move the optimizer state: "
            "drop --optimizer-cpu-offload (optimizer_cpu_offload=False)"
        )
    if getattr(config, "use_precision_aware_optimizer", False):
        raise ConfigError(
            "optimizer streaming replaces the precision-aware optimizer's state: drop "
            "--use-precision-aware-optimizer and choose the moment dtype with "
            "--stream-optimizer-state-moment-dtype"
        )
    if getattr(config, "optimizer_cuda_graph", False):
        raise ConfigError(
            "optimizer streaming reads buckets from disk inside the step, which a CUDA graph "
            "cannot capture: set optimizer_cuda_graph=False"
        )
    for name in ("main_params_dtype", "main_grads_dtype"):
        dtype = getattr(config, name, None)
        if dtype is not None and str(dtype) != "torch.float32":
            raise ConfigError(
                f"optimizer streaming keeps fp32 main params and grads: set "
                f"OptimizerConfig.{name}=torch.float32 (got {dtype})"
            )


def check_ddp_config(ddp_config) -> None:
    """Refuse a ``DistributedDataParallelConfig`` that streaming cannot serve."""
    if getattr(ddp_config, "use_megatron_fsdp", False) or getattr(ddp_config, "use_custom_fsdp", False):
        raise ConfigError(
            "optimizer streaming does not support Megatron FSDP (its main weights live in "
            "the FSDP buffers): set use_megatron_fsdp=False and use DDP with the "
            "distributed optimizer"
        )
    if getattr(ddp_config, "fp8_param_gather", False):
        raise ConfigError(
            "optimizer streaming does not support fp8 params (fp8_param_gather / --fp8-param-gather): "
            "keep the params in bf16 or fp16"
        )
    if getattr(ddp_config, "fp4_param_gather", False):
        raise ConfigError(
            "optimizer streaming does not support fp4 params (fp4_param_gather): keep the params in bf16 or fp16"
        )
    if not getattr(ddp_config, "use_distributed_optimizer", True):
        raise ConfigError(
            "optimizer streaming needs megatron's DistributedOptimizer: set "
            "DistributedDataParallelConfig.use_distributed_optimizer=True"
        )


def check_transformer_config(transformer_config) -> None:
    """Refuse fp8 model params declared on the model's ``TransformerConfig``."""
    if getattr(transformer_config, "fp8_param", False):
        raise ConfigError(
            "optimizer streaming does not support fp8 params (TransformerConfig.fp8_param / "
            "--fp8-param-gather): keep the params in bf16 or fp16"
        )


def check_inner_optimizer(inner) -> None:
    """Refuse an inner optimizer other than torch's Adam/AdamW (None: a stub, accepted).

    The streamed update calls torch's AdamW functional with the inner optimizer's
    settings, so it is bit-identical to torch's Adam; megatron picks TE's or Apex's
    FusedAdam when they are installed, whose arithmetic and state layout differ.
    """
    import torch

    if inner is None or isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return
    raise ConfigError(
        f"optimizer streaming supports torch's Adam/AdamW, the DistributedOptimizer wraps "
        f"{type(inner).__module__}.{type(inner).__name__}: use --optimizer adam without "
        "Transformer Engine's or Apex's FusedAdam"
    )


def check_step_decay(inner) -> None:
    """At each step: the streamed update is AdamW's (decoupled decay), so a group of a
    coupled-decay Adam may not carry weight decay. The build checks the config, but
    megatron's weight-decay schedule (``--start-weight-decay``/``--end-weight-decay``)
    sets each group's ``weight_decay`` after it, step by step."""
    for gi, group in enumerate(getattr(inner, "param_groups", None) or []):
        decay = group.get("weight_decay", 0.0)
        if not group.get("decoupled_weight_decay", True) and decay != 0.0:
            raise ConfigError(
                f"optimizer streaming computes AdamW (decoupled weight decay), but param group {gi} of "
                f"megatron's {type(inner).__name__} has coupled weight decay {decay} (a weight-decay "
                "schedule sets it after the build): set OptimizerConfig.decoupled_weight_decay=True"
            )
