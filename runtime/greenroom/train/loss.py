"""The policy-gradient loss the loop trains its actor on."""

from __future__ import annotations

import torch


def _token_logp(model, prompts, completions, device) -> torch.Tensor:
    seq = torch.cat([prompts, completions], dim=1).to(device)
    logits = model(seq[:, :-1])[:, prompts.shape[1] - 1 :]
    return torch.log_softmax(logits.float(), dim=-1).gather(2, completions.to(device).unsqueeze(-1)).squeeze(-1)


def policy_loss(
    model, prompts, completions, old_logp, advantages, clip: float, *, reference=None, kl_coef: float = 0.0
) -> torch.Tensor:
    """PPO's clipped surrogate over the completion tokens, plus ``kl_coef`` times the
    k3 estimate of KL(policy || reference) when a reference policy is given."""
    logp = _token_logp(model, prompts, completions, old_logp.device)
    ratio = torch.exp(logp - old_logp)
    a = advantages.unsqueeze(1)
    loss = -torch.min(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a).mean()
    if reference is not None:
        with torch.no_grad():
            log_ratio = _token_logp(reference, prompts, completions, old_logp.device) - logp.detach()
        # The gradient flows through the policy only; clamped as RL trainers do, since
        # exp() of a large log-ratio would swamp the policy loss.
        log_ratio = (log_ratio + logp - logp.detach()).clamp(-10.0, 10.0)
        loss = loss + kl_coef * (torch.exp(log_ratio) - log_ratio - 1).mean()
    return loss
