"""What a request costs, in GPU-milliseconds of a reference H200, and which class that puts it in.

prefill: every uncached token pays the context-independent work (MoE/MLP, KDA, projections) plus MLA
attention over everything before it; decode: every output token pays a step (amortised weights, KDA state)
plus reading the MLA latent cache of its whole context.

    prefill = u * (a + b * (c + u / 2))          u uncached tokens after c cached ones
    decode  = o * (s + r * (p + o / 2))          o output tokens after a p-token prompt

Calibration (docs/control-plane.md derives it): the default constants come from K3's shape (104 B active
parameters, 24 MLA layers with a 512 + 64 latent, 69 KDA layers with 207 MiB of state per sequence) on the
H200 roofline at a stated efficiency; `fit_prefill` replaces a and b by least squares on measured prefill
times, which is how an operator recalibrates for another model or GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

H200_BF16_FLOPS = 989e12
H200_HBM_BYTES_PER_S = 4.8e12
K3_ACTIVE_PARAMS = 104e9
K3_MLA_LAYERS = 24
K3_MLA_HEADS = 96  # assumption (not published): the KDA head count
MLA_LATENT, MLA_ROPE = 512, 64
K3_KDA_STATE_BYTES = 207 * 2**20
MLA_BYTES_PER_TOKEN = K3_MLA_LAYERS * MLA_LATENT * 2  # bf16 latent, the 24 KiB/token of the close reading
PREFILL_MFU = 0.5
DECODE_BATCH = 64
WEIGHT_BYTES_PER_PARAM = 1.0  # FP8 / MXFP4-mixed weights


@dataclass(frozen=True)
class CostModel:
    prefill_ms_per_token: float
    attention_ms_per_token_pair: float
    decode_ms_per_step: float
    decode_ms_per_context_token: float

    @classmethod
    def k3_h200(cls) -> CostModel:
        flops_ms = H200_BF16_FLOPS * PREFILL_MFU / 1e3
        # Weight absorption: scores over the 576-dim latent+rope key, values over the 512-dim latent.
        attention_flops = 2 * K3_MLA_LAYERS * K3_MLA_HEADS * (MLA_LATENT + MLA_ROPE + MLA_LATENT)
        bytes_ms = H200_HBM_BYTES_PER_S / 1e3
        step_bytes = 2 * K3_KDA_STATE_BYTES + K3_ACTIVE_PARAMS * WEIGHT_BYTES_PER_PARAM / DECODE_BATCH
        return cls(prefill_ms_per_token=2 * K3_ACTIVE_PARAMS / flops_ms,
                   attention_ms_per_token_pair=attention_flops / flops_ms,
                   decode_ms_per_step=step_bytes / bytes_ms,
                   decode_ms_per_context_token=MLA_BYTES_PER_TOKEN / bytes_ms)

    def prefill(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        uncached = max(prompt_tokens - cached_tokens, 0)
        context = min(cached_tokens, prompt_tokens)
        return uncached * (self.prefill_ms_per_token
                           + self.attention_ms_per_token_pair * (context + uncached / 2))

    def decode(self, prompt_tokens: int, output_tokens: int) -> float:
        return output_tokens * (self.decode_ms_per_step
                                + self.decode_ms_per_context_token * (prompt_tokens + output_tokens / 2))

    def cost(self, prompt_tokens: int, cached_tokens: int, max_output_tokens: int) -> float:
        return self.prefill(prompt_tokens, cached_tokens) + self.decode(prompt_tokens, max_output_tokens)

    def fit_prefill(self, samples: Sequence[tuple[int, int, float]]) -> CostModel:
        """Refit a and b from (prompt_tokens, cached_tokens, measured_ms) samples by least squares."""
        if len(samples) < 2:
            raise ValueError("samples: need at least two (prompt, cached, ms) measurements")
        rows, times = [], []
        for prompt, cached, ms in samples:
            u = max(prompt - cached, 0)
            rows.append([u, u * (min(cached, prompt) + u / 2)])
            times.append(ms)
        (a, b), *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(times, dtype=float), rcond=None)
        if a <= 0 or b < 0:
            raise ValueError(f"samples: the fit gave non-physical constants a={a:.3g}, b={b:.3g}")
        return replace(self, prefill_ms_per_token=float(a), attention_ms_per_token_pair=float(b))
