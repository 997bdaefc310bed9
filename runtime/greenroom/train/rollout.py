"""The rollout engine: its own copy of the policy's weights and a KV cache.

In the colocated shape the engine generates while the actor sleeps. Its weights are
refreshed from the actor after every train step (``sync_from``, while both are
resident), and its KV cache is allocated per rollout and dropped after it, so it
occupies the memory the sleeping actor gave back and returns it before the actor wakes.
"""

from __future__ import annotations

import torch

from greenroom.train.model import KVCache, ModelConfig, Transformer, set_precision


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    # An FSDP2 shard (DTensor) is gathered; a plain tensor is itself.
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class RolloutEngine:
    def __init__(self, config: ModelConfig, *, device: torch.device, precision: str = "fp32") -> None:
        # Built on the meta device and materialised in its precision: its weights are only
        # ever what sync_from copies in, so no initial values (or fp32 copy) are made.
        with torch.device("meta"):
            model = set_precision(Transformer(config), precision)
        self.model = model.to_empty(device=device).requires_grad_(False).eval()
        self.device = device
        self.last_cache_bytes = 0

    @torch.no_grad()
    def sync_from(self, actor: torch.nn.Module) -> None:
        """Copy the actor's current weights (every rank gets the full tensors)."""
        mine = dict(self.model.named_parameters())
        for name, p in actor.named_parameters():
            mine[name.removeprefix("module.")].copy_(full_tensor(p.detach()))

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, new_tokens: int, generator: torch.Generator, on_token=None):
        """Sample ``new_tokens`` per prompt at temperature 1.

        Returns the completions and the log-probability of each sampled token under
        the engine's weights (the "old" policy of the PPO ratio). Sampling draws from
        ``generator`` on the host, so a run is reproducible on any device.
        """
        b, p = prompts.shape
        cache = KVCache(self.model.config, b, p + new_tokens, device=self.device, dtype=self.model.embed.weight.dtype)
        self.last_cache_bytes = cache.nbytes
        logits = self.model(prompts.to(self.device), cache)[:, -1]
        tokens, logprobs = [], []
        for step in range(new_tokens):
            logp = torch.log_softmax(logits.float(), dim=-1)
            choice = torch.multinomial(logp.exp().cpu(), 1, generator=generator).to(self.device)
            tokens.append(choice)
            logprobs.append(logp.gather(1, choice))
            if on_token is not None:
                on_token()
            if step + 1 < new_tokens:
                logits = self.model(choice, cache)[:, -1]
        del cache
        return torch.cat(tokens, dim=1).cpu(), torch.cat(logprobs, dim=1).cpu()
