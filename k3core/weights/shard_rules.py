"""How each tensor of the model is laid out across tensor-parallel ranks, by name.

First matching rule wins; a tensor that no rule covers is an error, so a new tensor in the model
cannot silently be replicated (or mis-split) on the workers.

- KDA: every per-head tensor splits along its head dimension (q/k/v/b/f_b/g projections, the short
  convolutions, dt_bias, A_log); the low-rank down projections f_a/g_a and the per-head-shared
  o_norm are replicated; o_proj is row-parallel (split on its input).
- MLA: heads split (q_proj / q_b_proj, kv_b_proj, output gate); the latent path (q_a_proj,
  kv_a_proj_with_mqa, their norms) is replicated, so the cached latent is the same on every rank.
- MoE: routed experts are whole tensors owned by one rank each (expert parallel over the TP group);
  shared experts and dense MLPs are column/row parallel; router and latent projections replicated.
"""

from __future__ import annotations

import re

REPLICATE = "replicate"
EXPERT = "expert"
SPLIT_OUT = "split_out"  # column parallel: dim 0
SPLIT_IN = "split_in"  # row parallel: dim 1
SPLIT_HEADS = "split_heads"  # the per-head dim of a vector/conv/A_log (the largest dim)
VOCAB = "vocab"  # split dim 0 when the vocabulary divides, else replicate

_ATTN = r"model\.layers\.\d+\.self_attn\."
_MOE = r"model\.layers\.\d+\.block_sparse_moe\."
_MLP = r"model\.layers\.\d+\.mlp\."

RULES: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens\.weight", VOCAB),
    (r"lm_head\.weight", VOCAB),
    (r"model\.norm\.weight", REPLICATE),
    (r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight", REPLICATE),
    (r".*attn_res.*", REPLICATE),
    # attention (KDA and MLA share q_proj / o_proj / g_proj names and their layout)
    (_ATTN + r"(q_proj|k_proj|v_proj|b_proj|f_b_proj|g_b_proj|g_proj|q_b_proj|kv_b_proj)\.weight", SPLIT_OUT),
    (_ATTN + r"(q_conv1d|k_conv1d|v_conv1d)\.weight", SPLIT_OUT),
    (_ATTN + r"(dt_bias|A_log)", SPLIT_HEADS),
    (_ATTN + r"(f_a_proj|g_a_proj|q_a_proj|kv_a_proj_with_mqa)\.weight", REPLICATE),
    (_ATTN + r"(o_norm|q_a_layernorm|kv_a_layernorm)\.weight", REPLICATE),
    (_ATTN + r"o_proj\.weight", SPLIT_IN),
    # MoE
    (_MOE + r"experts\.\d+\.w[123]\.weight", EXPERT),
    (_MOE + r"gate\.(weight|e_score_correction_bias)", REPLICATE),
    (_MOE + r"(routed_expert_down_proj|routed_expert_up_proj|routed_expert_norm)\.weight", REPLICATE),
    (_MOE + r"shared_experts\.(gate_proj|up_proj)\.weight", SPLIT_OUT),
    (_MOE + r"shared_experts\.down_proj\.weight", SPLIT_IN),
    (_MLP + r"(gate_proj|up_proj)\.weight", SPLIT_OUT),
    (_MLP + r"down_proj\.weight", SPLIT_IN),
)
_COMPILED = tuple((re.compile(pattern), kind) for pattern, kind in RULES)
_EXPERT_ID = re.compile(r"\.experts\.(\d+)\.")


_DIGITS = re.compile(r"\d+")
# Rules only ever match numbers as \d+, so names that differ only in layer/expert numbers share a rule:
# memoised by that digit-free template (the k3 preset has ~250k tensors but ~100 templates).
_BY_TEMPLATE: dict[str, str | None] = {}


def rule_for(name: str) -> str | None:
    template = _DIGITS.sub("#", name)
    if template not in _BY_TEMPLATE:
        _BY_TEMPLATE[template] = next((kind for pattern, kind in _COMPILED if pattern.fullmatch(name)), None)
    return _BY_TEMPLATE[template]


def expert_id(name: str) -> int:
    match = _EXPERT_ID.search(name)
    assert match is not None, name
    return int(match.group(1))
