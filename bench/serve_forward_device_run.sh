#!/usr/bin/env bash
# The decode forward's kernels and step on the lent H200 in one device run (`run` with carry [".whl", ".device"];
# writes under $OUT):
#  W  in parallel, untimed: the GPU tests of the dense experts' forms and the side branches, one short
#     bench.serve pass over every variant and bench.serve_glue --compile-only shards (compiles, not timing, are
#     most of a cold run; they fill Triton's on-disk cache);
#  B  alone on the GPU, only if every GPU test passed: bench.serve (old vs new forms in one process, the kernel
#     profile of the process's own settings after the rows), bench.serve_glue (the dense experts' tilings, one
#     MoE layer per form and branch set, the MLA tilings), the MLA decode rows of the #9 bar (4K-64K).
set -u
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$(date +%s)
pip install -q --no-deps --target /tmp/site .whl/*.whl .device/wheels/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/protos TRITON_INTERPRET=0
stamp() { echo "$1 rc=$2 after $(( $(date +%s) - START )) s" >> "$OUT/env.txt"; }
python3 -c 'import sys,torch,triton;print(sys.version, torch.__version__, triton.__version__)' > "$OUT/env.txt" 2>&1
# The process's settings (the profile's): every new form; each variant names all three switches.
export K3_DECODE_BRANCHES=router+latent-early+rope+shared K3_DENSE_EXPERTS=tma-down K3_MLA_MERGE_LAST=1
SERVE=(--batches 64 --contexts 4096 1024 --prefix 0 --peer-batches --num-pages 16000
  --variant s7=K3_DECODE_BRANCHES=1,K3_DENSE_EXPERTS=tma-down,K3_MLA_MERGE_LAST=0
  --variant shared=K3_DECODE_BRANCHES=router+latent+shared,K3_DENSE_EXPERTS=tma-down,K3_MLA_MERGE_LAST=0
  --variant mla-br=K3_DECODE_BRANCHES=router+latent-early+rope+shared,K3_DENSE_EXPERTS=tma-down,K3_MLA_MERGE_LAST=0
  --variant merge=K3_DECODE_BRANCHES=router+latent-early+rope+shared,K3_DENSE_EXPERTS=tma-down,K3_MLA_MERGE_LAST=1
  --variant ws=K3_DECODE_BRANCHES=router+latent-early+rope+shared,K3_DENSE_EXPERTS=tma-ws,K3_MLA_MERGE_LAST=1)
GLUE=(--tokens 64 --sweep 64 --groups experts layer mla)
W=/tmp/warm; mkdir -p $W
( timeout -k 3 "${T_WARM:-70}" python3 -m pytest -p no:cacheprovider -q -m gpu tests/kernels/test_expert_gemm.py \
  > "$OUT/test.log" 2>&1; stamp test $? ) &
( timeout -k 3 "${T_WARM:-70}" python3 -m bench.serve "${SERVE[@]}" --steps 2 --out $W/serve.json > $W/serve.log 2>&1
  stamp "warm serve" $? ) &
for i in 0 1 2; do
  ( timeout -k 3 "${T_WARM:-70}" python3 -m bench.serve_glue "${GLUE[@]}" --compile-only --shard $i 3 \
    > $W/glue$i.log 2>&1; stamp "warm glue $i" $? ) &
done
wait
tail -n 3 $W/*.log > "$OUT/warm.log"
if grep -q " passed" "$OUT/test.log" && ! grep -qE "failed|error" "$OUT/test.log"; then
  timeout -k 3 "${T_SERVE:-60}" python3 -m bench.serve "${SERVE[@]}" --steps 30 --repeats 2 --profile 64 \
    --time-limit 45 --out "$OUT/serve.json" > "$OUT/serve.log" 2>&1
  stamp serve $?
  timeout -k 3 "${T_GLUE:-35}" python3 -m bench.serve_glue "${GLUE[@]}" --out "$OUT/glue.json" > "$OUT/glue.log" 2>&1
  stamp glue $?
  timeout -k 3 "${T_MLA:-25}" python3 -c 'from kernels.perf import mla_cases as m; from kernels.perf.harness import copy_bandwidth
bw = copy_bandwidth(); print(f"copy {bw / 1e9:.0f} GB/s")
for r in m.mla_rows(((64, 4096), (64, 16384), (64, 65536)), ({}, {"merge_last": True})):
    print(r.shape, r.impl, f"{r.ms * 1e3:.1f} us", f"{r.bytes / (r.ms * 1e-3) / bw:.1%}" if r.bytes else "", r.extra)' \
    > "$OUT/mla.log" 2>&1
  stamp mla $?
fi
cat "$OUT/env.txt"; tail -n 4 "$OUT/test.log"; grep -E "^ +64 " "$OUT/serve.log"; grep -E "expert_gate_up|MoeDecode|merge|rule" "$OUT/glue.log"
cat "$OUT/mla.log"
