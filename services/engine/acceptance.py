"""Which drafted tokens the target keeps: exact match for greedy requests, the standard rejection-sampling
rule (Leviathan et al. 2023; Chen et al. 2023) for sampled ones.

A verify step gives the target's logits at the pending token and after each of the n drafts. The result is
always the accepted drafts followed by exactly one token of the target: the correction at the first
rejected draft, or the bonus token after all n.

Distribution guarantee (sampling): draft d_i ~ q_i is kept with probability min(1, p_i(d_i) / q_i(d_i));
on rejection the token is drawn from norm(max(0, p_i - q_i)). Each emitted token then has exactly the
target's distribution p_i (after temperature, top-k and top-p, `sampler.sampling_probs`, normalised: the
rule needs p to sum to 1), given the tokens before it, whatever the draft. Randomness: the acceptance draw and
the residual draw of output position j use a CPU generator seeded from token_seed(seed, j), the bonus token
the sampler's own (seed, j) draw (`sample_next`), and the draft's draws a generator seeded from
(seed ^ DRAFT_SALT, j); so a run is reproducible for a given seed and draft. The
realised sequence differs from a non-speculative run of the same seed (same distribution, other draws);
greedy requests give exactly the non-speculative tokens.
"""

from __future__ import annotations

import torch

from services.engine.params import GenerationOptions
from services.engine.sampler import sample_next, sampling_probs, token_seed

DRAFT_SALT = 0x2545F4914F6CDD1D


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def draft_token(logits: torch.Tensor, options: GenerationOptions, index: int) -> tuple[int, torch.Tensor | None]:
    """The draft's proposal for output position `index` and the distribution it was drawn from (None when
    greedy: the draft proposes its argmax)."""
    if options.temperature == 0:
        return int(torch.argmax(logits)), None
    probs = sampling_probs(logits, options).cpu()
    token = int(torch.multinomial(probs, 1, generator=_generator(token_seed(options.seed ^ DRAFT_SALT, index))))
    return token, probs


def accept_drafts(target_logits: torch.Tensor, drafts: list[int], draft_probs: list[torch.Tensor] | None,
                  options: GenerationOptions, first_index: int) -> list[int]:
    """target_logits [len(drafts) + 1, V] -> the emitted tokens (accepted drafts, then one target token).
    `first_index` is the output position of the first draft."""
    if len(target_logits) != len(drafts) + 1:
        raise ValueError(f"{len(target_logits)} logit rows for {len(drafts)} drafts (need one more)")
    if options.temperature == 0:
        targets = torch.argmax(target_logits, dim=-1).tolist()
        kept = next((i for i, (d, t) in enumerate(zip(drafts, targets, strict=False)) if d != t), len(drafts))
        return drafts[:kept] + [targets[kept]]
    assert draft_probs is not None and len(draft_probs) == len(drafts)
    emitted: list[int] = []
    for i, (draft, q) in enumerate(zip(drafts, draft_probs, strict=True)):
        p = sampling_probs(target_logits[i], options).cpu()
        generator = _generator(token_seed(options.seed, first_index + i))
        # Keep with probability min(1, p/q): u < p/q, written without a division (q(draft) > 0: it was drawn).
        if float(torch.rand((), generator=generator)) * float(q[draft]) < float(p[draft]):
            emitted.append(draft)
            continue
        residual = (p - q).clamp_min(0)
        total = float(residual.sum())
        # total == 0 only when p == q up to rounding, where a rejection has probability 0: draw from p.
        emitted.append(int(torch.multinomial(residual / total if total > 0 else p, 1, generator=generator)))
        return emitted
    return emitted + [sample_next(target_logits[-1], options, first_index + len(drafts))]
