#!/usr/bin/env bash
# One device session's measurements in one `run` call, in order of value, each step under its own timeout:
#   1. fla-core from the carried .whl into $GPU_SESSION_SITE (the fla peers of bench.kernels need it)
#   2. python -m bench.serve (decode sweep first, then TTFT, then the transformers peer; --check, --profile 64)
#   3. python -m bench.kernels, one --only group per process, merged into one JSON (a slow or broken group
#      loses only its own rows; rows of groups not re-measured stay from bench/results/kernels.json)
#
# On the device (docs/kernels.md, docs/serving.md):
#   run(command="bash bench/gpu_session.sh", carry=[".whl"], timeout_s=600)
# GPU_SESSION_SERVE=0 skips step 2; GPU_SESSION_KERNELS="group:cap_s ..." picks the kernel groups.
# Everything it keeps lands in $OUT: session.txt (each step's exit status and seconds, the card), serve.json,
# serve.log, serve_profile.txt (fast-path check + kernel profile at batch 64), kernels.json, kernels.log.
# CPU dry run of the same steps (nano, tiny shapes; bench.kernels exits 2 without CUDA):
#   OUT=/tmp/gs PYTHON=.venv/bin/python GPU_SESSION_SITE=/tmp/gs-site bash bench/gpu_session.sh --cpu
set -u

mode=${1:-gpu}
if [[ $mode != gpu && $mode != --cpu ]]; then
    echo "usage: bash bench/gpu_session.sh [--cpu]" >&2
    exit 2
fi
: "${OUT:?OUT must name the folder for the results (the run tool sets it)}"
PY=${PYTHON:-python3}
SITE=${GPU_SESSION_SITE:-/tmp/site}
BUDGET_S=${GPU_SESSION_BUDGET_S:-540}  # the whole script; run's timeout_s (600) leaves the rest for the copy back
RESERVE_S=20                           # kept for the summary at the end (and timeout's kill grace)
KERNEL_GROUPS=${GPU_SESSION_KERNELS:-kda_decode:110 mla:60 moe:60 kda_verify:60 attnres:50 attnres_phase1:60 kda_prefill:240}  # kda_prefill: fla autotunes ~50 s a shape

mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$SITE:$PWD:$PWD/protos${PYTHONPATH:+:$PYTHONPATH}"  # protos: the k3.v1 stubs (bench.serve_engine)
STATUS=$OUT/session.txt
: >"$STATUS"

# step NAME LOG CAP_S CMD...: CMD under `timeout` of min(CAP_S, budget left), output appended to $OUT/LOG.
step() {
    local name=$1 log=$2 cap=$3 left limit began rc
    shift 3
    left=$((BUDGET_S - SECONDS - RESERVE_S))
    if ((left < 15)); then
        echo "$name: skipped (budget spent)" | tee -a "$STATUS"
        return 0
    fi
    limit=$((cap < left ? cap : left))
    began=$SECONDS
    echo "=== $name (limit ${limit} s)" >>"$OUT/$log"
    timeout -k 10 "$limit" "$@" >>"$OUT/$log" 2>&1
    rc=$?
    local note=""
    ((rc == 124 || rc == 137)) && note=", TIMED OUT"
    echo "$name: rc=$rc, $((SECONDS - began)) s of $limit s$note" | tee -a "$STATUS"
}

{
    echo "mode $mode, started $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm \
        --format=csv,noheader
    "$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__,
"triton", triton.__version__, "cuda", torch.cuda.is_available())'
} >>"$STATUS" 2>&1

if compgen -G ".whl/*.whl" >/dev/null; then
    step install_fla install.log 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" .whl/*.whl
else
    echo "install_fla: no .whl/*.whl (carry [\".whl\"]): the fla peers will report import errors" | tee -a "$STATUS"
fi

# grpcio, prometheus-client (the engine loop that bench.serve's decode rows drive), carried as .device
if compgen -G ".device/wheels/*.whl" >/dev/null && [[ $mode == gpu ]]; then
    step install_wheels install.log 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" .device/wheels/*.whl
fi

if [[ $mode == --cpu ]]; then
    export K3_DECODE_FASTPATH=1  # the fast path on the CPU, kernels through their references
    serve_args=(--model nano --batches 1 2 --contexts 32 --steps 2 --prefix 64 --increment 16 --hash-block 16
        --budget 32 --num-pages 96 --peer-batches --profile 2)
else
    serve_args=(--batches 1 16 64 256 --contexts 1024 4096 --steps 10 --prefix 32768 --increment 512
        --peer-batches 1 16 --peer-steps 5 --num-pages 16000 --profile 64)
fi
if [[ ${GPU_SESSION_SERVE:-1} == 1 ]]; then  # GPU_SESSION_SERVE=0: kernels only (a table refresh)
    step serve serve.log 210 "$PY" -m bench.serve "${serve_args[@]}" --check --time-limit 150 --out "$OUT/serve.json"
else
    echo "serve: skipped (GPU_SESSION_SERVE=0)" | tee -a "$STATUS"
fi
grep -sE '^(fast path \(|experts touched|profile batch|  +[0-9.]+ ms +[0-9]+x)' "$OUT/serve.log" \
    >"$OUT/serve_profile.txt"

[[ -f bench/results/kernels.json ]] && cp bench/results/kernels.json "$OUT/kernels.json"
for entry in $KERNEL_GROUPS; do
    group=${entry%%:*}
    step "kernels $group" kernels.log "${entry##*:}" "$PY" -m bench.kernels --only "$group" \
        --out "$OUT/kernels.json" --merge-from "$OUT/kernels.json"
done

# The run tool's reply shows the last 12,000 characters: the most important part last.
echo "--- kernels (this session's rows)"
grep -sE '^(ceilings|kda_|mla_|attnres|situ_glu|latent_moe|launch_floor|group .* failed|\[)' "$OUT/kernels.log" |
    cut -c1-160
echo "--- profile"
head -n 30 "$OUT/serve_profile.txt" 2>/dev/null | cut -c1-200
echo "--- serve"
grep -sE '^(model |TTFT|peer|  *batch  *context|  *[0-9]+  +[0-9]+  +[0-9.]+ )' "$OUT/serve.log"
echo "--- session ($SECONDS s)"
cat "$STATUS"
exit 0
