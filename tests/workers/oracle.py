"""The offline oracle: k3core's model on its contiguous cache, one sequence, whole-prompt prefill and
step-by-step decode, with the same per-request seeded sampling. No scheduler, pool, transfer or TP."""

from __future__ import annotations

import torch

from k3core.model import K3Model
from k3core.model.init import init_weights
from k3core.presets import preset
from services.engine.params import GenerationOptions
from services.engine.sampler import sample_next


def build_reference(model: str = "nano", overrides: dict | None = None, seed: int = 0) -> K3Model:
    config = preset(model).replace(**(overrides or {}))
    return init_weights(K3Model(config), seed=seed).eval()


@torch.no_grad()
def offline_generate(model: K3Model, prompt: list[int], options: GenerationOptions) -> list[int]:
    cache = model.new_sequence_cache()
    logits = model.prefill(torch.tensor(prompt), cache, 0)[-1]
    out: list[int] = []
    eos = model.config.eos_token_id
    while True:
        token = sample_next(logits.float(), options, len(out))
        out.append(token)
        if token in options.stop_token_ids or (token == eos and not options.ignore_eos):
            return out
        if len(out) >= options.max_tokens:
            return out
        logits = model.decode(torch.tensor([token]), [cache])[0]
