#!/usr/bin/env bash
# The decode forward's forms on the lent H200 in one device run (`run` with carry [".whl", ".device"]; writes
# under $OUT), one after another on a cold machine (each bench compiles its Triton kernels in its warm-up):
#  T  (TESTS=1) the GPU tests of the dense experts' forms and the side branches;
#  S  bench.serve: session 7's forward against each new form in one process, the kernel profile of the
#     process's own settings (every new form) after the rows;
#  G  bench.serve_glue: one MoE layer per dense form and branch set at 64 tokens;
#  M  the MLA decode at B=64, 1K-64K (the #9 bar: >= 75 % of copy at 4K-64K), the launcher's merge kernel
#     against the merge by the last split, each with its error against the reference.
set -u
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$(date +%s)
pip install -q --no-deps --target /tmp/site .whl/*.whl .device/wheels/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/protos TRITON_INTERPRET=0
stamp() { echo "$1 rc=$2 after $(( $(date +%s) - START )) s" >> "$OUT/env.txt"; }
python3 -c 'import sys,torch,triton;print(sys.version, torch.__version__, triton.__version__)' > "$OUT/env.txt" 2>&1
if [ "${TESTS:-0}" = 1 ]; then
  timeout -k 3 "${T_TEST:-60}" python3 -m pytest -p no:cacheprovider -q -m gpu tests/kernels/test_expert_gemm.py \
    > "$OUT/test.log" 2>&1
  stamp test $?
fi
# The process's settings (the profile's): every new form; each variant names all of the switches.
export K3_DECODE_BRANCHES=router+latent-early+rope+shared K3_DENSE_EXPERTS=tma-down K3_MLA_MERGE_LAST=1
NEW=router+latent-early+rope+shared
timeout -k 3 "${T_SERVE:-75}" python3 -m bench.serve --batches 64 --contexts 4096 1024 --prefix 0 --peer-batches \
  --num-pages 16000 --steps 30 --repeats 2 --profile 64 --time-limit "${SERVE_LIMIT:-60}" --out "$OUT/serve.json" \
  --variant s7=K3_DECODE_BRANCHES=1,K3_MLA_MERGE_LAST=0 \
  --variant shared=K3_DECODE_BRANCHES=router+latent+shared,K3_MLA_MERGE_LAST=0 \
  --variant mla-br=K3_DECODE_BRANCHES=$NEW,K3_MLA_MERGE_LAST=0 \
  --variant merge=K3_DECODE_BRANCHES=$NEW,K3_MLA_MERGE_LAST=1 > "$OUT/serve.log" 2>&1
stamp serve $?
timeout -k 3 "${T_GLUE:-25}" python3 -m bench.serve_glue --tokens 64 --groups layer --out "$OUT/glue.json" \
  > "$OUT/glue.log" 2>&1
stamp glue $?
timeout -k 3 "${T_MLA:-25}" python3 -c 'from kernels.perf import mla_cases as m; from kernels.perf.harness import copy_bandwidth
bw = copy_bandwidth(); print(f"copy {bw / 1e9:.0f} GB/s")
for r in m.mla_rows(((64, 1024), (64, 4096), (64, 16384), (64, 65536)), ({}, {"merge_last": True})):
    print(r.shape, r.impl, f"{r.ms * 1e3:.1f} us", f"{r.bytes / (r.ms * 1e-3) / bw:.1%}" if r.bytes else "", r.extra)' \
  > "$OUT/mla.log" 2>&1
stamp mla $?
cat "$OUT/env.txt"; grep -E "^ +64 " "$OUT/serve.log"; grep -E "MoeDecode" "$OUT/glue.log"; cat "$OUT/mla.log"
