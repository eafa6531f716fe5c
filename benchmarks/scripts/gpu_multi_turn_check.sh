#!/usr/bin/env bash
# Multi-turn KV reuse (issue 38) on the lent GPU machine:
#   bash benchmarks/scripts/gpu_multi_turn_check.sh
#       pd-bench turn-ttft on synthetic:llama3-8b bf16, 1P1D on this GPU with a cluster secret:
#       a turn adding 512 tokens to an 8K-token conversation against a fresh 512-token prompt
#       (target: TTFT ratio <= 1.3), and the turn's hand-off bytes (moved vs skipped);
#       then tests/gpu/test_suffix_handoff_gpu.py (a second turn moves only its new blocks,
#       written in place and sent, cold tokens) and tests/gpu/test_kv_offload_gpu.py
#   DRY_RUN=1 bash benchmarks/scripts/gpu_multi_turn_check.sh    the same on a CPU, small shapes
#       (synthetic:smollm2-135m fp32, a 512-token context + 64; the ratio is not judged)
#       PYTHON picks the interpreter (default python3)
# Writes its logs to $OUT when set (the device tool's output folder).
# On the GPU machine carry .whl (the nodes' KV transport, the router's and nodes' gRPC health and
# reflection, which the image lacks), made by: ../shared/tools/gpu-wheels.sh grpcio==1.85.3 \
#   protobuf==7.36.2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1 && [ "${DRY_RUN:-0}" != 1 ]; then
  SITE=$(mktemp -d)
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl ||
    { echo "gpu_multi_turn_check: installing .whl failed"; exit 2; }
  export PYTHONPATH="$SITE:$PYTHONPATH"
fi
py="${PYTHON:-python3}"
log_dir="${OUT:-/tmp}"
mkdir -p "$log_dir"
if [ "${DRY_RUN:-0}" = 1 ]; then
  bench=(--model synthetic:smollm2-135m --dtype float32 --device cpu --context 512
         --new-tokens 64 --repeats 2 --target-ratio 1000 --serve-arg=--kv-transport=tcp)
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  bench=(--model synthetic:llama3-8b --dtype bfloat16 --device cuda --context 8192
         --new-tokens 512 --repeats 5 --serve-arg=--max-model-len=16384)
fi
echo "== pd-bench turn-ttft ${bench[*]}"
"$py" -m benchmarks.cli turn-ttft "${bench[@]}" 2>&1 | tee "$log_dir/turn_ttft.log"
bench_rc=${PIPESTATUS[0]}
tests_rc=0
if [ "${DRY_RUN:-0}" != 1 ]; then
  "$py" -m pytest tests/gpu/test_suffix_handoff_gpu.py tests/gpu/test_kv_offload_gpu.py -q \
      -p no:cacheprovider -o addopts="" -rs 2>&1 |
    tee "$log_dir/multi_turn_gpu_tests.log" | tail -n 15
  tests_rc=${PIPESTATUS[0]}
fi
echo "multi-turn: benchmark exit code $bench_rc, tests exit code $tests_rc"
[ "$bench_rc" = 0 ] && [ "$tests_rc" = 0 ]
