#!/usr/bin/env bash
# KDA prefill on the lent H200 in one device run (`run` with carry [".whl"]; writes under $OUT):
#  W  Triton compiles first, in parallel: fla at its three new-kernel shapes (autotune results discarded),
#     ours once per variant on a small case;
#  F0 the default (and $F0_VARIANTS, comma-separated labels) vs the fla-core composition at all four shapes
#     (fla then only benchmarks its configs);
#  A  the variants ($VARIANTS, comma-separated labels of kda_prefill_tuning.py) at B=1,T=32K, no peer;
#  F1 pick_tuning's choice from A at all four shapes, if it differs from the default.
# BUDGET (s, from the start of this script) bounds the whole; each phase gets what is left, F0 keeping
# RESERVE s for A and F1 when VARIANTS is set. Round 4 (history 20 in docs/kernels.md) ran this with
# T_WARM=70 and RESERVE=55: F0 was cut in fla's B=8 autotuning. Session 5 (history 21): BUDGET=163,
# T_WARM=80 gave no row at all (warm-ups cut, F0's 71 s spent in fla's first autotuning): a same-run
# comparison with fla needs BUDGET >= 240 with the default T_WARM=130, about 300 device-seconds in all.
# Session 6 (history 26): BUDGET=272 T_WARM=115 F0_PEER=second, 5 of ours + fla at four shapes: warm-ups
# 118 s (fla's compiles), F0 96 s; 244 device-seconds from a cold start.
# Triton's on-disk cache (session 7): every process compiles into $TRITON_CACHE_DIR; CACHE_IN (a .tgz or its
# parts CACHE_IN.00, .01, ..., e.g. a previous run's, copied to the carried .device/) is unpacked there first,
# so fla's compiles (112 of session 7's 210 s) and its autotuning on the timed shapes (cached by the F0
# process: FLA_CACHE_RESULTS) come from it; SAVE_CACHE=1 packs the cache to $OUT/kda_triton_cache.tgz.NN in
# 15 MiB parts (files come back only up to 16 MiB each: session 7's single 28.6 MB archive did not). Session
# 7's second run returned one (26.5 MB in two parts: ours' four variants, fla's kernels of all three warm-ups
# up to their cut and its 32K autotuning), kept in .device/ as kda_triton_cache.tgz.00 / .01 for CACHE_IN.
# Session 7's third run (history 31), carry [".whl", ".device"]: warm-ups 65 s with that cache (none cut), F0
# (default, fla, three variants) 59 s; its own cache replaced the .device/ parts. Session 8 (history 33), warm
# machine, the same carry, BUDGET=170 T_WARM=100 SAVE_CACHE=1 F0_PEER=second F0_VARIANTS="ut akk regs":
# warm-ups 55 s, F0 (default, fla, one variant) 17 s, the cache packed after 77 s; 78 device-seconds.
set -u
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$(date +%s)
pip install --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/kda_triton_cache}"
mkdir -p "$TRITON_CACHE_DIR"
CACHE_IN="${CACHE_IN:-.device/kda_triton_cache.tgz}"
compgen -G "$CACHE_IN*" >/dev/null && cat "$CACHE_IN"* | tar xz -C "$TRITON_CACHE_DIR"
save_cache() {
  [ "${SAVE_CACHE:-0}" = 1 ] || return 0
  tar cz -C "$TRITON_CACHE_DIR" . | split -b 15m -d - "$OUT/kda_triton_cache.tgz." && log "cache saved"
}
left() { echo $(( ${BUDGET:-240} - ($(date +%s) - START) )); }
# A phase's time limit: what is left less $1, at least 1 s (`timeout 0` would mean no limit at all).
limit() { local s=$(( $(left) - $1 )); echo $(( s > 1 ? s : 1 )); }
log() { echo "$1 after $(( $(date +%s) - START )) s" >> "$OUT/env.txt"; }
python3 -c 'import sys,torch,triton;print(sys.version, torch.__version__, triton.__version__)' > "$OUT/env.txt" 2>&1
VARIANTS="${VARIANTS-}"
RESERVE=$([ -n "$VARIANTS" ] && echo "${RESERVE:-55}" || echo 3)
F0_VARIANTS="default${F0_VARIANTS:+,$F0_VARIANTS}"
# Each warm-up logs its exit status and time (124: cut by T_WARM; session 5 could not tell which was cut).
warm() { local f=$1; shift; "$@" > "$f" 2>&1; echo "rc=$? after $(( $(date +%s) - START )) s" >> "$f"; }
KDA_PREFILL_VARIANTS="$F0_VARIANTS${VARIANTS:+,$VARIANTS}" warm "$OUT/warm_ours.log" timeout -k 3 "${T_WARM:-130}" \
  python3 -m kernels.perf.kda_prefill_cases --warm-ours &
for s in "B=1,T=32K" "B=8" "varlen"; do
  FLA_CACHE_RESULTS=0 warm "$OUT/warm_peer_${s//[^A-Za-z0-9]/_}.log" timeout -k 3 "${T_WARM:-130}" \
    python3 -m kernels.perf.kda_prefill_cases --warm-peer "$s" &
done
wait; log "warm"
# Ours first (F0_PEER=last): a limit that falls inside fla's autotuning then still leaves ours measured;
# F0_PEER=second: the default, fla, then the F0 variants (a new variant that faults loses only what follows).
# A peer warm-up cut by T_WARM forces ours first: session 7's second run (fla's compiles 126 s against
# T_WARM=118) spent F0 compiling fla in-process after its 32K row, and no variant was timed.
PEER_ORDER="${F0_PEER:-last}"
if grep -q "^rc=124" "$OUT"/warm_peer_*.log; then PEER_ORDER=last; log "a peer warm-up was cut: ours first"; fi
# One log file for the warm-ups: only 8 files come back from a run (session 7's second run lost one).
for f in "$OUT"/warm_*.log; do { echo "== ${f##*/}"; cat "$f"; } >> "$OUT/warm.log"; rm -f "$f"; done
KDA_PREFILL_PEER="$PEER_ORDER" KDA_PREFILL_ROWS="$OUT/final.jsonl" KDA_PREFILL_VARIANTS="$F0_VARIANTS" \
  timeout -k 3 "$(limit "$RESERVE")" python3 -m bench.kernels --only kda_prefill --out "$OUT/final.json" \
  > "$OUT/final.log" 2>&1
log "final rc=$?"
[ -n "$VARIANTS" ] || { save_cache; exit 0; }
KDA_PREFILL_ROWS="$OUT/variants.jsonl" KDA_PREFILL_PEER=0 KDA_PREFILL_SHAPES="B=1,T=32K" \
KDA_PREFILL_VARIANTS="default,$VARIANTS" timeout -k 3 "$(limit 20)" \
  python3 -m bench.kernels --only kda_prefill --out "$OUT/variants.json" > "$OUT/variants.log" 2>&1
log "variants rc=$?"
PICK=$(python3 -m kernels.perf.kda_prefill_cases "$OUT/variants.jsonl" 2>>"$OUT/env.txt")
[ -n "$PICK" ] || PICK='{}'
log "pick $PICK"
if [ "$PICK" != "{}" ] && [ "$(left)" -gt 8 ]; then
  KDA_PREFILL_ROWS="$OUT/picked.jsonl" KDA_PREFILL_PEER=0 KDA_PREFILL_VARIANTS=default KDA_PREFILL_TUNING="$PICK" \
    timeout -k 2 "$(limit 3)" python3 -m bench.kernels --only kda_prefill --out "$OUT/picked.json" \
    > "$OUT/picked.log" 2>&1
  log "picked rc=$?"
fi
save_cache
