#!/usr/bin/env bash
# AttnRes on the lent H200 in one device run (`run` with carry [".device"]; writes under $OUT):
#  W  in parallel: the GPU tests of the AttnRes kernels (TESTS: block logits, apply, merge), and the bench's
#     sections run once untimed (each compiles its Triton kernels into the shared on-disk cache: compiles,
#     not timing, are most of a cold run);
#  B  `bench.kernels --only $BENCH_GROUPS` alone on the GPU (default attnres_phase1,attnres_decode: phase 1 at the
#     fixed shapes and as served, the merges and whole decode forwards per launch form).
# B runs only if every GPU test passed (no timing of wrong numbers).
set -u
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$(date +%s)
pip install -q --no-deps --target /tmp/site .device/wheels/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/protos TRITON_INTERPRET=0
stamp() { echo "$1 rc=$2 after $(( $(date +%s) - START )) s" >> "$OUT/env.txt"; }
python3 -c 'import sys,torch,triton;print(sys.version, torch.__version__, triton.__version__)' > "$OUT/env.txt" 2>&1
for f in ${TESTS:-block_logits inter merge_norm}; do
  ( timeout -k 3 "${T_WARM:-35}" python3 -m pytest -p no:cacheprovider -q -m gpu "tests/kernels/test_attnres_$f.py" \
    > "$OUT/test_$f.log" 2>&1; stamp "test $f" $? ) &
done
# EXTRA_TESTS: more GPU tests (pytest ids) run beside the warm-ups, not gating the bench (e.g. the decode engine's
# captured graphs, whose forward runs the AttnRes side branch).
for t in ${EXTRA_TESTS:-}; do
  ( timeout -k 3 "${T_WARM:-35}" python3 -m pytest -p no:cacheprovider -q -m gpu "$t" > "$OUT/extra_$(basename "${t%%.py*}").log" 2>&1
    stamp "extra $t" $? ) &
done
UNTIMED='import sys, kernels.perf.attnres_cases as c
c.time_ms = lambda fn, *a, **k: (fn(), (0.0, "untimed"))[1]
tokens, forwards = (tuple(x for x in arg.split(",") if x) for arg in sys.argv[1:3])
c.phase1_rows(tuple(map(int, tokens)), forwards)'
warm() {
  local name=$1; shift
  ( timeout -k 3 "${T_WARM:-35}" python3 -c "$UNTIMED" "$@" > "$OUT/warm_$name.log" 2>&1; stamp "warm $name" $? ) &
}
DECODE='import sys, kernels.perf.attnres_decode_cases as c
c.time_ms = lambda fn, *a, **k: (fn(), (0.0, "untimed"))[1]
c.merge_rows() if sys.argv[1] == "merges" else c.forward_rows((sys.argv[1],))'
warm_decode() {
  ( timeout -k 3 "${T_WARM:-35}" python3 -c "$DECODE" "$1" > "$OUT/warm_decode_$1.log" 2>&1; stamp "warm $1" $? ) &
}
warm decode 64 ""
warm prefill 8192 ""
warm k3 "" k3
warm mini "" mini
for part in merges k3 mini; do warm_decode $part; done
wait
if ! grep -LZ " passed" "$OUT"/test_*.log | grep -q . && ! grep -qE "failed|error" "$OUT"/test_*.log; then
  timeout -k 3 "${T_BENCH:-40}" python3 -m bench.kernels --only "${BENCH_GROUPS:-attnres_phase1,attnres_decode}" \
    --merge-from /nonexistent --out "$OUT/attnres.json" > "$OUT/bench.log" 2>&1
  stamp bench $?
fi
cat "$OUT/env.txt"; tail -n 3 "$OUT"/test_*.log "$OUT"/warm_*.log "$OUT"/extra_*.log 2>/dev/null; grep -v "^ \|^\[\|^{\|^}\|^\]" "$OUT/bench.log" | head -90
