"""``quantization_config`` of an MXFP4 checkpoint, in the compressed-tensors form the K3 release uses.

Only MoE expert weights are MXFP4; everything else (attention projections, latent-MoE projections,
shared experts, router, embeddings, lm_head) stays in higher precision (§4.1.4). A quantised weight
``X.weight`` is stored as ``X.weight_packed`` (uint8 ``[out, in/2]``) and ``X.weight_scale`` (uint8 e8m0
``[out, in/32]``); see k3core.quant.mxfp4 for the bit layout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from k3core.quant.mxfp4 import BLOCK
from k3core.weights.errors import CheckpointError

FORMAT = "mxfp4-pack-quantized"
PACKED_SUFFIX = ".weight_packed"
SCALE_SUFFIX = ".weight_scale"
# Routed-expert projections (Kimi Linear names): the only MXFP4 tensors.
EXPERT_TARGETS = (r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$",)
# The released K3 ignore list (close reading §3.4) plus the names the report says stay in higher
# precision but that list leaves implicit (router, latent-MoE projections, embeddings).
K3_IGNORE = (
    r"re:.*self_attn.*",
    r"re:.*shared_experts.*",
    r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    r"re:.*lm_head.*",
    r"re:.*vision_tower.*",
    r"re:.*mm_projector.*",
    r"re:.*block_sparse_moe\.gate$",
    r"re:.*routed_expert_(down|up)_proj$",
    r"re:.*embed_tokens$",
)


def logical_weight_name(name: str) -> str:
    """The ``X.weight`` an MXFP4 part (``X.weight_packed`` or ``X.weight_scale``) encodes; other names as is."""
    for suffix in (PACKED_SUFFIX, SCALE_SUFFIX):
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight"
    return name


def _matches(module: str, patterns: tuple[str, ...]) -> bool:
    """compressed-tensors matching: ``re:`` regex, else an exact module name; the class target
    ``Linear`` is every weight matrix (the ignore list then carves out the high-precision parts)."""
    return any(
        re.match(p[3:], module) if p.startswith("re:") else p in ("Linear", module) for p in patterns
    )


@dataclass(frozen=True)
class MxQuantConfig:
    targets: tuple[str, ...] = EXPERT_TARGETS
    ignore: tuple[str, ...] = K3_IGNORE
    group_size: int = BLOCK
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def quantizes(self, module: str) -> bool:
        """Whether ``module`` (a tensor name without ``.weight``) is stored as MXFP4."""
        return _matches(module, self.targets) and not _matches(module, self.ignore)

    def to_hf_dict(self) -> dict[str, Any]:
        weights = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": self.group_size,
                   "symmetric": True, "dynamic": False}  # fmt: skip
        return {
            **self.extra,
            "quant_method": "compressed-tensors",
            "format": FORMAT,
            "config_groups": {"group_0": {"targets": list(self.targets), "weights": weights}},
            "ignore": list(self.ignore),
        }

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> MxQuantConfig:
        groups = raw.get("config_groups") or {}
        # Newer compressed-tensors releases may record the format per group instead of at the top.
        formats = {raw.get("format")} if raw.get("format") else {g.get("format") for g in groups.values()}
        if formats != {FORMAT}:
            raise CheckpointError(f"quantization_config.format: only {FORMAT!r} is supported, got {sorted(map(str, formats))}")
        targets: list[str] = []
        for name, group in groups.items():
            weights = group.get("weights") or {}
            if weights.get("num_bits") != 4 or weights.get("type") != "float" or weights.get("group_size") != BLOCK:
                raise CheckpointError(
                    f"quantization_config.config_groups.{name}.weights: MXFP4 needs num_bits 4, type float, "
                    f"group_size {BLOCK}; got {weights}"
                )
            targets += group.get("targets", [])
        known = {"quant_method", "format", "config_groups", "ignore"}
        return cls(
            targets=tuple(targets) or EXPERT_TARGETS,
            ignore=tuple(raw.get("ignore", ())),
            extra={k: v for k, v in raw.items() if k not in known},
        )
