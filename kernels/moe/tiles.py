"""Tile shapes of the latent-MoE decode kernels (one per kernel: gate/up and down tune apart), and the launcher's
defaults: tiles, Gluon stages and which form serves a call when the caller names none (measured, see each).

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


# The Gluon kernels' cp.async stages and down tile where the caller names none (session 8, history 32, same
# run, us at T = 1 / 4 / 16: gate/up 17.1 / 46.9 / 124.7 against the Triton kernel's 23.4 / 66.3 / 164.3, 2
# stages alike, 4 slower at T = 4 / 16; down at 4 warps 10.1 / 25.8 / 63.8, at 2 warps (the Triton kernel's
# default) 11.0 / 27.5 / 68.4, Triton 13.5 / 36.5 / 93.9). The gate/up tile stays default_tiles' 64 x 128 at
# 2 warps: 4 warps or 32 rows were slower at T = 4 / 16.
GLUON_STAGES = 3
GLUON_DOWN_TILE = Tile(128, 128, 4, 3)
# gluon_fused's (gate/up, down) tiles where the caller names neither (one launch: equal warps) and cp.async
# stages (session 10, history 43, same runs, whole call us at T = 4: 70.2 / 68.9 at 2 + 2 stages against 70.4 /
# 72.1 at 3 + 3; 4-warp tiles 71.0-71.5; the two-launch default 74.7 / 76.5).
FUSED_TILES = (Tile(64, 128, 2, 3), Tile(128, 128, 2, 3))
FUSED_STAGES = (2, 2)


def fused_by_default(pairs: int, sms: int) -> bool:
    """Whether a call of `pairs` (token, expert) pairs takes the one-launch form when the caller names no tiles:
    from 48 pairs (T = 3 at k = 16: 61.0 us against 62.7 / 63.2, one run, history 44; T = 4 faster in three runs,
    history 43-44) while the mma.sync gate/up is the default (fewer pairs than SMs). At 16 and 32 pairs (T = 1, 2)
    it measured slower (41-42 us against 30; 57.6 against 44.4): every item is resident at once and the tickets,
    taken in arrival order, put the gate/up items on a few SMs (at T = 1 on 76 of 132, up to 4 each; traced in
    history 44); from T = 3 there are more gate/up items than resident programs, so the tickets balance them."""
    return 48 <= pairs < sms


def wgmma_by_default(pairs: int, sms: int) -> bool:
    """Whether a call of `pairs` (token, expert) pairs takes gate/up on warpgroup MMAs when the caller names no
    gate/up tile: from as many pairs as SMs (session 8, history 35, same run, us at T = 1 / 4 / 16: gate/up
    16.9 / 46.8 / 120.0 against mma.sync's 17.0 / 47.0 / 128.6; whole call 31.7 / 77.8 / 183.2 against 30.0 /
    77.9 / 193.2: faster at T = 16, alike at 4, slower at 1)."""
    return pairs >= sms
