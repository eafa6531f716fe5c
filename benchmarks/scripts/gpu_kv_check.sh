#!/usr/bin/env bash
# Issue 9 on the lent H200 (one GPU): the KV hand-off figures, one command.
#   carry .whl made by: ../shared/tools/gpu-wheels.sh grpcio==1.85.1 protobuf==7.35.1 \
#     grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1   (routers run with --http-port 0)
#   bash benchmarks/scripts/gpu_kv_check.sh   -> $OUT/kv_transfer.txt, $OUT/kv_ttft.txt
# 1. pd-bench transfer: one 8192-token llama3-8b request (1 GiB bf16) prefill process -> decode
#    process, both on the one GPU, written in place (--in-place) and then sent over ucx: pack,
#    unpack, end to end, the HBM copy ceiling and the raw ucxx GPU-to-GPU bandwidth between the
#    same two processes, measured in the same run.
# 2. pd-bench ttft: synthetic:llama3-8b bf16, 1P1D (both nodes on the GPU, ucx) against colocated,
#    idle single requests at 2K and 8K prompt tokens, median/p90, ratio, last request's timeline.
# Budget: ~4 minutes. The whole GPU check of issue 9: this, then `python3 -m pytest tests/gpu`.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp}"
ls .whl/*.whl >/dev/null 2>&1 || { echo "gpu_kv_check: no .whl (see the header)"; exit 2; }
SITE=$(mktemp -d)
timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl ||
  { echo "gpu_kv_check: installing .whl failed"; exit 2; }
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
rc_transfer=0
for mode in --in-place ""; do  # written in place (what nodes on one GPU do), then sent over ucx
  echo "== pd-bench transfer --transport ucx --device cuda --model llama3-8b --prompt-tokens 8192 --iters 5 $mode"
  timeout -k 10 120 python3 -m benchmarks.cli transfer --transport ucx --device cuda --model llama3-8b \
    --prompt-tokens 8192 --iters 5 $mode >"$out/kv_transfer.log" 2>&1 || rc_transfer=$?
  grep -v '^\[' "$out/kv_transfer.log" | tee -a "$out/kv_transfer.txt" | tail -n 30
done
echo "exit code: $rc_transfer"
echo "== pd-bench ttft --model synthetic:llama3-8b --dtype bfloat16 --device cuda --transport ucx --prompt-tokens 2048 8192 --requests 9 --warmup 2"
timeout -k 10 240 python3 -m benchmarks.cli ttft --model synthetic:llama3-8b --dtype bfloat16 \
  --device cuda --transport ucx --prompt-tokens 2048 8192 --requests 9 --warmup 2 --serve-arg=--http-port=0 \
  >"$out/kv_ttft.log" 2>&1
rc_ttft=$?
grep -v '^\[' "$out/kv_ttft.log" | tee "$out/kv_ttft.txt" | tail -n 60
echo "exit code: $rc_ttft"
[ "$rc_transfer" -eq 0 ] && [ "$rc_ttft" -eq 0 ]
