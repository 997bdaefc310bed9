"""A small megatron-core GPT training setup, for the GPU tests and the bench.

TP=PP=DP=1 on an NCCL process group of one rank (or the TP/DP layout the caller's
parallel state was set up with: the multi-GPU tests), a ``GPTModel`` from the local layer
spec (no Transformer Engine), bf16 params under DDP with the distributed optimizer, and
one extra native-fp32 parameter (like an SSM's ``A_log``) so that the resident path runs.
The batches are a fixed function of the seed and the step, so two runs see the same data.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSize:
    """The GPT's shape."""

    hidden: int = 256
    """Hidden size."""

    layers: int = 2
    """Number of transformer layers."""

    heads: int = 4
    """Attention heads."""

    vocab: int = 1024
    """Vocabulary size."""

    seq: int = 64
    """Sequence length."""

    batch: int = 2
    """Micro-batch size."""


def init_single_gpu(port: int = 29533) -> None:
    """A world of one NCCL rank and megatron's model-parallel groups (all of size 1)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def build_model(size: ModelSize, *, seed: int = 1234):
    """A bf16 GPTModel wrapped in megatron's DDP with the distributed optimizer's buffers."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=size.layers,
        hidden_size=size.hidden,
        num_attention_heads=size.heads,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # The layers split across the TP group megatron's parallel state was set up with.
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
    )
    with torch.device("cuda"):
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=size.vocab,
            max_sequence_length=size.seq,
        )
    # As megatron's training does: every param (the local spec's norms too) in bf16, and
    # the inputs and outputs cast at the model's edges.
    module = Float16Module(config, gpt)
    # A native-fp32 parameter, as a router's expert_bias or an SSM's A_log would be.
    gpt.register_parameter("aux_fp32", torch.nn.Parameter(torch.full((40,), 0.5, dtype=torch.float32, device="cuda")))
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)


def optimizer_config(**overrides):
    from megatron.core.optimizer import OptimizerConfig

    settings = dict(
        optimizer="adam",
        lr=1e-3,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        bf16=True,
        use_distributed_optimizer=True,
        clip_grad=1.0,
    )
    settings.update(overrides)
    return OptimizerConfig(**settings)


def batch(size: ModelSize, step: int, *, seed: int = 1234) -> dict:
    g = torch.Generator(device="cpu").manual_seed(seed * 1000 + step)
    tokens = torch.randint(0, size.vocab, (size.batch, size.seq + 1), generator=g).cuda()
    positions = torch.arange(size.seq, device="cuda").unsqueeze(0).expand(size.batch, -1)
    causal = torch.tril(torch.ones((1, 1, size.seq, size.seq), device="cuda")) < 0.5
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": positions, "attention_mask": causal}


def train_step(model, optimizer, size: ModelSize, step: int) -> float:
    """Forward, backward, DDP grad sync and one optimizer step; returns the loss."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    data = batch(size, step)
    losses = model(data["input_ids"], data["position_ids"], data["attention_mask"], labels=data["labels"])
    aux = model.module.module.aux_fp32
    loss = losses.float().mean() + (aux * aux).sum() * 1e-2
    loss.backward()
    model.finish_grad_sync()
    success, _, _ = optimizer.step()
    assert success, "the optimizer skipped a step (inf/nan grads)"
    return float(loss)
