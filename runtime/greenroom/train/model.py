"""A small decoder-only transformer in plain torch, with a KV cache for generation.

Pre-norm blocks, learned positions, ``scaled_dot_product_attention``. Sizes come from
``ModelConfig``; the default is small enough to train on a 2-core CPU in two minutes
(a wider one learns the task more slowly: d_model 128 had not left chance after 60
iterations where 64 reaches 0.7 by 40).

Precisions (``--dtype``): ``mixed`` (the default) keeps the matrices, biases and
embeddings in bf16 and the LayerNorm weights in fp32, as mixed-precision trainers do.
With streaming, every bf16 param streams with its fp32 master and moments whatever its
size (``StreamingAdam``'s resident threshold, ``greenroom.optim.RESIDENT_NUMEL``, applies
to fp32 params only), and the small fp32 norms stay resident under that threshold: the
main job moves real bytes every optimizer step. ``bf16`` and ``fp32`` make every param
that dtype (``fp32`` at this size streams nothing: every param is under the threshold).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from greenroom.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Transformer sizes."""

    vocab_size: int = 16
    """Number of token ids (the task's alphabet)."""

    d_model: int = 64
    """Width of the residual stream."""

    n_layers: int = 2
    """Number of transformer blocks."""

    n_heads: int = 4
    """Attention heads per block; must divide ``d_model``."""

    ff_mult: int = 4
    """MLP hidden width as a multiple of ``d_model``."""

    max_seq_len: int = 32
    """Longest prompt plus completion."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "ff_mult", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"--d-model {self.d_model} must be a multiple of --n-heads {self.n_heads}")

    def num_params(self) -> int:
        d, f = self.d_model, self.ff_mult * self.d_model
        block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
        return self.vocab_size * d + self.max_seq_len * d + self.n_layers * block + 2 * d + d * self.vocab_size


PRECISIONS = ("mixed", "bf16", "fp32")


def set_precision(model: nn.Module, precision: str) -> nn.Module:
    """Cast ``model``'s params to ``precision`` (see the module doc), in place."""
    if precision not in PRECISIONS:
        raise ConfigError(f"--dtype: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    model.to(torch.float32 if precision == "fp32" else torch.bfloat16)
    if precision == "mixed":
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.float()  # fp32 weights; the norm itself runs in fp32 (LayerNorm below)
    return model


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 and returned in the input's dtype.

    Under ``mixed`` its weights are fp32 and the residual stream bf16. CPU kernels take
    that mix, CUDA's do not ("expected scalar type BFloat16 but found Float"), and the
    statistics of a bf16 row lose precision anyway, so the norm runs in fp32 on every
    device, as mixed-precision trainers run it.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


class KVCache:
    """Keys and values of every layer for ``batch`` sequences of up to ``max_len``."""

    def __init__(self, config: ModelConfig, batch: int, max_len: int, *, device, dtype) -> None:
        shape = (config.n_layers, batch, config.n_heads, max_len, config.d_model // config.n_heads)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.length = 0

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.d_model
        self.n_heads = config.n_heads
        self.norm1 = LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = LayerNorm(d)
        self.up = nn.Linear(d, config.ff_mult * d)
        self.down = nn.Linear(config.ff_mult * d, d)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        if cache is None:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            start = cache.length
            cache.k[layer, :, :, start : start + t] = k
            cache.v[layer, :, :, start : start + t] = v
            keys, values = cache.k[layer, :, :, : start + t], cache.v[layer, :, :, : start + t]
            # A prefill from position 0 is causal; a one-token decode sees everything.
            attn = F.scaled_dot_product_attention(q, keys, values, is_causal=(start == 0 and t > 1))
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.max_seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                # Residual projections scaled down with depth (GPT-2's recipe).
                scale = 1 / math.sqrt(2 * self.config.n_layers) if name.endswith(("proj.weight", "down.weight")) else 1
                nn.init.normal_(p, std=std * scale)
            elif "norm" not in name:
                nn.init.zeros_(p)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        start = 0 if cache is None else cache.length
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for i, block in enumerate(self.blocks):
            x = block(x, cache, i)
        if cache is not None:
            cache.length += tokens.shape[1]
        return self.head(self.norm(x))
