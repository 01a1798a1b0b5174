"""Tile shapes of the latent-MoE decode kernels (one per kernel: gate/up and down tune apart).

Both kernels stream weight rows: a program owns `rows` rows of one expert and walks the reduction `cols`
columns per step. Each step decodes rows x cols MXFP4 weights in registers, so the tile sets both how many
programs exist (rows) and how much fixed per-step work (activation fragments, scale bytes, pipeline
bookkeeping) each decoded word carries (rows x cols); `max_registers` caps ptxas so that more programs
share an SM; `splits` (down kernel) cuts the reduction between programs whose partial rows the last kernel
adds, for more programs when few experts are routed.
"""

from __future__ import annotations

from dataclasses import dataclass

from kernels._triton import next_pow2, require


@dataclass(frozen=True)
class Tile:
    rows: int = 128
    cols: int = 128
    warps: int = 4
    stages: int = 3
    max_registers: int | None = None
    splits: int = 1  # programs per row block, each over 1 / splits of the reduction (down kernel only)

    def label(self) -> str:
        cap = f",r{self.max_registers}" if self.max_registers else ""
        split = f",k{self.splits}" if self.splits > 1 else ""
        return f"{self.rows}x{self.cols},w{self.warps},s{self.stages}{cap}{split}"

    def groups(self, depth: int) -> int:
        """32-column groups per step over a reduction of `depth` columns (cols capped at the depth of one
        split)."""
        require(self.splits >= 1 and depth % (32 * self.splits) == 0,
                f"tile splits={self.splits} must divide the reduction of {depth} columns into 32-column groups")
        depth //= self.splits
        rows, cols = self.rows, min(self.cols, depth)
        require(rows >= 16 and rows == next_pow2(rows), f"tile rows must be a power of two >= 16, got {rows}")
        require(cols % 32 == 0 and cols == 32 * next_pow2(cols // 32) and depth % cols == 0,
                f"tile cols={self.cols} must be 32 x a power of two dividing {depth}")
        require(self.warps in (1, 2, 4, 8, 16), f"tile warps must be a power of two <= 16, got {self.warps}")
        require(self.stages >= 1, f"tile stages must be >= 1, got {self.stages}")
        return cols // 32

    def launch_options(self) -> dict:
        opts: dict = {"num_warps": self.warps}
        if self.max_registers:
            opts["maxnreg"] = self.max_registers
        return opts


def default_tiles(pairs: int, sms: int) -> tuple[Tile, Tile]:
    """(gate/up, down) tiles for `pairs` (token, expert) pairs (T x k) on `sms` SMs (the choice depends on
    how many programs there are per SM, not on the experts' width). 2-warp programs, 64 x 128 gate/up and
    128 x 128 down (history 23). Measured on the H200 as whole calls in one run (history 25, blocked
    experts): with fewer pairs than SMs (T = 1, 4 at k = 16) two stages (one step in flight) 40.5 / 106.2 us
    against 42.1 / 109.7 with three (and the session-5 down split at T = 1); from as many pairs as SMs
    (T = 16) three stages and registers capped at 168 (6 programs per SM instead of 4) 263.3 us against
    293.5 (T = 4: 125.0, slower). 16-row tiles and a CUDA-core path (since removed) were slower at
    T = 1 / 2 / 4 (history 27)."""
    if pairs < sms:
        return Tile(64, 128, 2, 2), Tile(128, 128, 2, 2)
    return Tile(64, 128, 2, 3, 168), Tile(128, 128, 2, 3, 168)
