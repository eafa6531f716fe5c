#!/usr/bin/env bash
# Issue 40 item 2 on one lent GPU: where the 1P1D / colocated TTFT ratio's time goes at 2K and
# 8K prompt tokens. pd-bench ttft --breakdown: synthetic:llama3-8b bf16, 1P1D (both nodes on the
# GPU, ucx) against colocated, 9 idle single requests per length after 2 warm-up, every measured
# request traced; per length a table splits the median TTFT into router, hop and node rows.
#   carry .whl made by: ../shared/tools/gpu-wheels.sh grpcio==1.85.1 protobuf==7.35.1 \
#     grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 llguidance==1.9.1
#   (routers run with --http-port 0, so the FastAPI stack is not needed; the engine imports
#   llguidance for structured outputs)
#   bash benchmarks/scripts/gpu_ttft_breakdown.sh        -> $OUT/ttft_breakdown.txt (~4 minutes)
#   DRY_RUN=1 bash benchmarks/scripts/gpu_ttft_breakdown.sh   CPU: synthetic:tiny-llama, tcp,
#                                                           48/160 tokens, 2 requests (no .whl)
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
args=(--model synthetic:llama3-8b --dtype bfloat16 --device cuda --transport ucx
  --prompt-tokens 2048 8192 --requests 9 --warmup 2 --breakdown)
if [ "${DRY_RUN:-0}" = 1 ]; then
  args=(--model synthetic:tiny-llama --device cpu --transport tcp --prompt-tokens 48 160
    --requests 2 --warmup 1 --breakdown)
else
  ls .whl/*.whl >/dev/null 2>&1 || { echo "gpu_ttft_breakdown: no .whl (see the header)"; exit 2; }
  SITE=$(mktemp -d)
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl ||
    { echo "gpu_ttft_breakdown: installing .whl failed"; exit 2; }
  export PYTHONPATH="$SITE:$PYTHONPATH"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
fi
echo "== pd-bench ttft ${args[*]}"
timeout -k 10 480 python3 -m benchmarks.cli ttft "${args[@]}" >"$out/ttft_breakdown.log" 2>&1
rc=$?
grep -v '^\[' "$out/ttft_breakdown.log" | tee "$out/ttft_breakdown.txt" | tail -n 80
echo "exit code: $rc"
exit "$rc"
