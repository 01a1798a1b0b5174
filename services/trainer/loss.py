"""The per-token off-policy regularised policy loss used for partial rollouts.

Trajectories may carry tokens sampled by several older policy versions, so the objective is kept local per
token: the policy-gradient term uses the token's advantage, a quadratic penalty on the token's log-ratio to
the behaviour policy keeps the update in a neighbourhood of it, and tokens whose log-ratio left a hard trust
region get no gradient at all (they are too stale to be informative). On-policy data (ratio 1) reduces it
to REINFORCE with the given advantages.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Rewards of the K samples of one prompt minus their mean (no std division: keeps reward scale)."""
    return rewards - rewards.mean(dim=-1, keepdim=True)


def per_token_policy_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
                          loss_mask: torch.Tensor, tau: float = 0.1, max_log_ratio: float = 2.0) -> torch.Tensor:
    """logp, behaviour_logp, loss_mask: [B, T]; advantages: [B] (per trajectory) or [B, T]."""
    if advantages.ndim == 1:
        advantages = advantages[:, None].expand_as(logp)
    log_ratio = logp - behaviour_logp.detach()
    inside = (log_ratio.detach().abs() <= max_log_ratio) & loss_mask.bool()
    per_token = -advantages.detach() * logp + 0.5 * tau * log_ratio.pow(2)
    per_token = torch.where(inside, per_token, torch.zeros_like(per_token))
    return per_token.sum() / loss_mask.sum().clamp(min=1)
