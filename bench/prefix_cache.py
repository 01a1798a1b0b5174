"""Fine-grained KDA-aware prefix cache vs a block-grid-only cache on a multi-turn agentic trace.

    python bench/prefix_cache.py [--sessions 200] [--gib 16 32] [--cpu-gib 256] [--seed 0]

Replays a synthetic agentic trace against the scheduler-side cache manager (metadata only: page ids and
chain hashes, no tensors) at K3 / TP8 shapes, for two configurations at the same GPU pool bytes:

- fine (this cache): 256-token hash blocks inside the physical blocks the sizing function picks (768
  tokens at K3 TP8, 8 % KDA page padding; the report's 512 gives 1024-token blocks and 31 % padding, also
  replayed); KDA checkpoints at the end of each forward, superseded ones reclaimed, turn boundaries kept,
  a waypoint checkpoint every 64K prefilled tokens, checkpoints capped at a quarter of the pool, and the
  cost-aware eviction order of `k3core.cache.retention`.
- block grid (the peer, modelled on vLLM's hybrid "align" prefix caching): hash block = physical block =
  1536 tokens (what the same sizing gives at that grid); a recurrent state is cached at every block-aligned
  forward end (prefill chunks snapped to the grid, every block crossed in decode) and kept until LRU
  eviction (one LRU over all entries, tail blocks of a finished request first), with no supersession and
  no cap.

Memory: both get the same pool bytes, and everything either caches lives in pool pages (MLA blocks,
checkpoints, private states, with their padding), so the comparison is at equal memory by construction;
the table reports the average split of the pool at turn starts.

Trace: sessions run `--concurrent` at a time (a new one starts when one ends); each has a shared system
prompt, a first prompt of 10K-300K tokens (log-uniform), and 10-40 turns; each turn decodes 200-1500
tokens and appends a tool result so that the context grows 1-4K tokens per turn, capped at 400K. Turns run
one at a time (prefill in 8K chunks snapped to the hash grid, decode in hash-block segments, which
changes no cache state compared to token-by-token decode).

A second part times the scheduler-side cache operations per decode step with 256 running requests
(`bench/cache_ops.py`), against a 1 ms/step budget.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from prometheus_client import CollectorRegistry

from bench.cache_ops import measure
from k3core.cache.checkpoints import CheckpointPolicy
from k3core.cache.cpu_tier import CpuTier
from k3core.cache.layout import PoolLayout, plan_layout, shape_from_config
from k3core.cache.manager import PrefixCacheManager
from k3core.cache.metrics import CacheMetrics
from k3core.cache.pool import PageKind
from k3core.presets import preset

RESULTS = Path(__file__).resolve().parent / "results" / "prefix_cache.json"
GIB = 2**30
SYSTEM_PROMPT = 6_000
PREFILL_CHUNK = 8192
MAX_CONTEXT = 400_000


@dataclass
class Session:
    sid: int
    first_prompt: int
    turns: list[tuple[int, int]]  # (decoded tokens, tool-result tokens appended after them)
    _chains: dict[int, list[int]] = field(default_factory=dict)

    def chain(self, hash_block: int, num_tokens: int) -> list[int]:
        """Chain hashes of this session's first `num_tokens // hash_block` hash blocks. A block lying
        wholly inside the shared system prompt has the same content in every session."""
        chain = self._chains.setdefault(hash_block, [])
        while len(chain) < num_tokens // hash_block:
            i = len(chain)
            content = ("system", i) if (i + 1) * hash_block <= SYSTEM_PROMPT else (self.sid, i)
            chain.append(hash((chain[-1] if chain else 0, hash_block, content)))
        return chain[: num_tokens // hash_block]


def make_trace(num_sessions: int, seed: int) -> list[Session]:
    rng = random.Random(seed)
    sessions = []
    for sid in range(num_sessions):
        first = int(math.exp(rng.uniform(math.log(10_000), math.log(300_000))))
        turns, context = [], first
        for _ in range(rng.randint(10, 40)):
            decoded = rng.randint(200, 1500)
            growth = max(decoded, rng.randint(1000, 4000))
            if context + growth > MAX_CONTEXT:
                break
            turns.append((decoded, growth - decoded))
            context += growth
        sessions.append(Session(sid, first, turns))
    return sessions


@dataclass(frozen=True)
class Scheme:
    name: str
    hash_block: int
    policy: CheckpointPolicy

    def layout(self) -> PoolLayout:
        return plan_layout(shape_from_config(preset("k3"), "k3"), tp=8, hash_block_tokens=self.hash_block)


# Agentic turns extend the previous turn's output, so the prompt-end checkpoint is not kept here.
FINE = Scheme("fine (this cache)", 256, CheckpointPolicy(max_pool_fraction=0.25, keep_prompt_end=False))
FINE_512 = Scheme("fine, 512-token hash blocks", 512, FINE.policy)
GRID = Scheme("block grid 1536 (vLLM-align-like)", 1536,
              CheckpointPolicy(supersede=False, keep_prompt_end=False, max_pool_fraction=1.0, eviction="lru",
                               waypoint_tokens=0, branch_points=False))
# The peer given this cache's branch points (a forward ends, and a state is kept, where a shared prefix
# ends, here on its grid): shown so that the gain of branch points is not mistaken for the grid's loss.
GRID_BRANCH = Scheme("block grid 1536 + branch points", 1536, replace(GRID.policy, branch_points=True))


def turn_order(sessions: list[Session], concurrent: int, seed: int) -> Iterator[tuple[Session, int, int, int]]:
    """The trace's turns in the order both replays take them: up to `concurrent` conversations open at once
    (the next waiting one opens when one ends), each turn drawn from a random open conversation. Yields
    (session, turn, context length, tokens decoded (at least 1))."""
    rng = random.Random(seed)
    waiting = list(sessions)
    active: list[tuple[Session, int, int]] = []  # (session, next turn, context length)
    while waiting or active:
        while waiting and len(active) < concurrent:
            session = waiting.pop(0)
            active.append((session, 0, session.first_prompt))
        i = rng.randrange(len(active))
        session, turn, context = active[i]
        decoded, tool = session.turns[turn] if turn < len(session.turns) else (0, 0)
        decoded = max(decoded, 1)
        yield session, turn, context, decoded
        if turn + 1 >= len(session.turns):
            active.pop(i)
        else:
            active[i] = (session, turn + 1, context + decoded + tool)


def _forward(manager: PrefixCacheManager, rid: str, tokens: int) -> None:
    manager.reserve(rid, tokens)
    manager.forward_done(rid)
    manager.commit_step()


def run_turn(manager: PrefixCacheManager, session: Session, rid: str, prompt: int, decoded: int) -> int:
    hb = manager.layout.hash_block_tokens
    hit = manager.add_request(rid, chain=session.chain(hb, prompt), num_tokens=prompt)
    req = manager.requests[rid]
    while req.num_computed < prompt:
        _forward(manager, rid, manager.prefill_chunk(rid, PREFILL_CHUNK))
    produced = 0
    while produced < decoded:  # decode, in segments that end where token-by-token decode would snapshot
        segment = min(decoded - produced, hb - req.num_tokens % hb)
        before = req.num_tokens
        full = session.chain(hb, before + segment)
        manager.append_hashes(rid, segment, full[before // hb :])
        _forward(manager, rid, segment)
        produced += segment
    manager.finish(rid)
    return hit


def replay(scheme: Scheme, pool_gib: float, sessions: list[Session], concurrent: int, seed: int,
           cpu_gib: float = 0.0) -> dict:
    layout = scheme.layout()
    pages = int(pool_gib * GIB // layout.page_bytes)
    for session in sessions:
        session._chains.clear()
    cpu = CpuTier(int(cpu_gib * GIB)) if cpu_gib else None
    registry = CollectorRegistry()
    manager = PrefixCacheManager(layout, pages, policy=scheme.policy, cpu_tier=cpu, metrics=CacheMetrics(registry))
    prompt_tokens = reused = turns = peak_checkpoint_pages = 0
    split = {"mla": 0, "checkpoint": 0, "free": 0}  # pool pages at turn starts, summed over turns
    start = time.perf_counter()
    for session, turn, context, decoded in turn_order(sessions, concurrent, seed):
        split["mla"] += manager.pool.kind.count(PageKind.MLA)
        split["checkpoint"] += manager.checkpoints.num_pages  # between turns every KDA page is a checkpoint
        split["free"] += manager.pool.num_free
        hit = run_turn(manager, session, f"{session.sid}:{turn}", context, decoded)
        prompt_tokens += context
        reused += hit
        turns += 1
        peak_checkpoint_pages = max(peak_checkpoint_pages, manager.checkpoints.num_pages)
    return {
        "scheme": scheme.name, "pool_gib": pool_gib, "cpu_gib": cpu_gib, "hash_block": layout.hash_block_tokens,
        "tokens_per_block": layout.tokens_per_block, "page_mib": layout.page_bytes / 2**20, "pages": pages,
        "turns": turns, "prompt_tokens": prompt_tokens, "reused_tokens": reused,
        "prefill_tokens_computed": prompt_tokens - reused, "reuse_fraction": reused / prompt_tokens,
        "peak_checkpoint_gib": peak_checkpoint_pages * layout.page_bytes / GIB,
        "pool_bytes": pages * layout.page_bytes,
        **{f"avg_{k}_gib": v / turns * layout.page_bytes / GIB for k, v in split.items()},
        "avg_kda_padding_gib": split["checkpoint"] / turns * layout.kda_padding_bytes / GIB,
        "evictions": manager.pool.evictions, "replay_s": time.perf_counter() - start,
        **{f"cpu_{d}_gib": (registry.get_sample_value("k3_prefix_cache_cpu_tier_bytes_total", {"direction": d})
                            or 0.0) / GIB for d in ("offload", "prefetch")},
    }


def recency_ceiling(layout: PoolLayout, pool_gib: float, sessions: list[Session], concurrent: int,
                    seed: int) -> int:
    """Reused tokens of an idealised cache on the same trace and pool: a conversation costs exactly its
    MLA blocks and one checkpoint and nothing else is held (no padding, leftovers or superseded entries), a
    running turn holds its whole context, pressure trims the least recently used conversation from its
    tail block by block (as if it had a checkpoint at every block), and every miss reuses the shared
    system prompt (counted in each conversation's memory, so this errs low by its few blocks). It ranks conversations by recency, as
    any policy must that cannot tell which conversations have ended: the reference for how much of the gap
    to a goal better eviction could still close on this trace."""
    per_block, hb, ckpt = layout.tokens_per_block, layout.hash_block_tokens, layout.num_kda_groups
    capacity = int(pool_gib * GIB // layout.page_bytes)
    resident: OrderedDict[int, int] = OrderedDict()  # session -> tokens held, least recently used first
    used = 0  # pages held by `resident`
    reused = shared = 0
    for session, _, context, decoded in turn_order(sessions, concurrent, seed):
        held = resident.pop(session.sid, 0)
        used -= -(-held // per_block) + ckpt if held else 0
        reused += max(min(held, context - 1), shared) // hb * hb
        shared = SYSTEM_PROMPT  # from the first turn on, the system prompt is always held (hit by every miss)
        end = context + decoded
        need = -(-end // per_block) + ckpt
        while used + need > capacity and resident:
            sid, tokens = next(iter(resident.items()))
            pages = -(-tokens // per_block)
            keep = pages - (used + need - capacity)
            used -= pages + ckpt
            if keep > 0:
                resident[sid] = keep * per_block
                resident.move_to_end(sid, last=False)
                used += keep + ckpt
            else:
                del resident[sid]
        resident[session.sid] = end
        used += need
    return reused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--concurrent", type=int, default=16)
    parser.add_argument("--gib", type=float, nargs="+", default=[16.0, 32.0], help="GPU pool sizes")
    parser.add_argument("--cpu-gib", type=float, default=256.0, help="CPU tier of the last rows (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sessions = make_trace(args.sessions, args.seed)
    configs = [(gib, 0.0, (FINE, FINE_512, GRID_BRANCH, GRID)) for gib in args.gib]
    if args.cpu_gib:
        configs.append((args.gib[0], args.cpu_gib, (FINE, GRID)))
    rows = []
    print("| GPU pool GiB | CPU tier GiB | scheme | hash/block tokens | reused tokens | prefill computed | reuse "
          "| ratio vs grid | pool split MLA/ckpt/free GiB (avg) | of which KDA padding GiB | peak ckpt GiB "
          "| evictions | CPU offload/prefetch GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for gib, cpu_gib, schemes in configs:
        group = [replay(scheme, gib, sessions, args.concurrent, args.seed, cpu_gib) for scheme in schemes]
        grid = group[-1]
        if not cpu_gib:
            group[0]["recency_ceiling_tokens"] = recency_ceiling(FINE.layout(), gib, sessions, args.concurrent,
                                                                 args.seed)
        for row in group:
            row["ratio_vs_grid"] = ratio = row["reused_tokens"] / max(grid["reused_tokens"], 1)
            assert row["pool_bytes"] <= gib * GIB  # equal memory: nothing lives outside the pool
            print(f"| {row['pool_gib']:.0f} | {row['cpu_gib']:.0f} | {row['scheme']} "
                  f"| {row['hash_block']}/{row['tokens_per_block']} | {row['reused_tokens']:,} "
                  f"| {row['prefill_tokens_computed']:,} | {row['reuse_fraction']:.1%} | {ratio:.2f}x "
                  f"| {row['avg_mla_gib']:.1f}/{row['avg_checkpoint_gib']:.1f}/{row['avg_free_gib']:.1f} "
                  f"| {row['avg_kda_padding_gib']:.2f} | {row['peak_checkpoint_gib']:.1f} | {row['evictions']:,} "
                  f"| {row['cpu_offload_gib']:.0f}/{row['cpu_prefetch_gib']:.0f} |", flush=True)
        if "recency_ceiling_tokens" in group[0]:
            ceiling = group[0]["recency_ceiling_tokens"]
            print(f"| {gib:.0f} | 0 | idealised recency cache (reference, see recency_ceiling) "
                  f"| {FINE.hash_block}/{group[0]['tokens_per_block']} | {ceiling:,} | | "
                  f"{ceiling / group[0]['prompt_tokens']:.1%} | {ceiling / grid['reused_tokens']:.2f}x | | | | | |")
        rows += group
    timing = measure()
    wall, cpu = timing["wall"], timing["cpu"]
    print(f"\nscheduler-side cache ops per decode step, {timing['running']} running requests, a turn ending every "
          f"{timing['churn_every']} steps (bench/cache_ops.py has the variants): wall p50 {wall['p50_ms']:.3f} / "
          f"p99 {wall['p99_ms']:.3f} / mean {wall['mean_ms']:.3f} ms, thread CPU p50 {cpu['p50_ms']:.3f} / p99 "
          f"{cpu['p99_ms']:.3f} / mean {cpu['mean_ms']:.3f} ms (budget 1 ms / mean: CPU {1 / cpu['mean_ms']:.1f}x, "
          f"wall {1 / wall['mean_ms']:.1f}x)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"trace": vars(args), "replays": rows, "decode_step_timing": timing}, indent=2))


if __name__ == "__main__":
    main()
