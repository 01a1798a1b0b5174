"""Print the pool sizing of the model presets: `python -m k3core.cache.sizing_report [preset ...]`."""

from __future__ import annotations

import sys

import torch

from k3core.cache.layout import PoolLayout, plan_layout, shape_from_config
from k3core.presets import preset

DEFAULT_PRESETS = ("nano", "mini", "k3")
MIB = 2**20


def layout_rows(names: tuple[str, ...] = DEFAULT_PRESETS, tps: tuple[int, ...] = (1, 8),
                state_dtype: torch.dtype = torch.float32) -> list[PoolLayout]:
    rows = []
    for name in names:
        shape = shape_from_config(preset(name), name)
        for tp in tps:
            if shape.kda_heads % tp == 0:
                rows.append(plan_layout(shape, tp, state_dtype=state_dtype))
    return rows


def format_table(rows: list[PoolLayout]) -> str:
    header = ("| preset | TP | groups KDA+MLA (layers each) | page bytes | tokens/block | KDA used | KDA padding "
              "| checkpoint MiB | MLA KiB/token |")
    lines = [header, "|" + "---|" * 9]
    for lay in rows:
        per_token = lay.num_mla_groups * lay.layers_per_group * lay.mla_token_bytes / 1024
        lines.append(
            f"| {lay.shape.name} | {lay.tp} | {lay.num_kda_groups}+{lay.num_mla_groups} ({lay.layers_per_group}) "
            f"| {lay.page_bytes:,} | {lay.tokens_per_block} | {lay.kda_page_used_bytes:,} "
            f"| {lay.kda_padding_bytes:,} ({lay.kda_padding_bytes / lay.page_bytes:.1%}) "
            f"| {lay.checkpoint_bytes() / MIB:.2f} | {per_token:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    names = tuple(argv if argv is not None else sys.argv[1:]) or DEFAULT_PRESETS
    print(f"state fp32, conv and MLA latent bf16, hash block 512\n{format_table(layout_rows(names))}")
    for name in names:
        heads = preset(name).kda_num_heads
        if heads % 8:
            print(f"({name} at TP 8: not a valid layout, {heads} KDA heads cannot be split 8 ways)")


if __name__ == "__main__":
    main()
