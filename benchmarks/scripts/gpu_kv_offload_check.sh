#!/usr/bin/env bash
# The host KV tier (engine/kv_offload, issue 38) on the lent GPU machine:
#   bash benchmarks/scripts/gpu_kv_offload_check.sh
#       tests/gpu/test_kv_offload_gpu.py (byte-exact demotion and promotion through page-locked
#       memory, stream ordering, tokens of a promoted prefix), then pd-bench kv-offload on
#       synthetic:llama3-8b bf16, an 8K-token prefix: promotion beside the host -> device copy
#       rate measured in the same run (target >= 50%), demotion beside device -> host
#   DRY_RUN=1 bash benchmarks/scripts/gpu_kv_offload_check.sh    the same on a CPU, small shapes
#       (the GPU tests skip); PYTHON picks the interpreter (default python3)
# Writes logs and the benchmark's JSON to $OUT when set (the device tool's output folder).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
log_dir="${OUT:-/tmp}"
mkdir -p "$log_dir"
if [ "${DRY_RUN:-0}" = 1 ]; then
  bench=(--device cpu --dtype float32 --model synthetic:tiny-llama --tokens 256 --iters 2)
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  bench=(--model synthetic:llama3-8b --dtype bfloat16 --tokens 8192 --iters 10)
fi
"$py" -m pytest tests/gpu/test_kv_offload_gpu.py -q -p no:cacheprovider -o addopts="" -rs 2>&1 |
  tee "$log_dir/kv_offload_gpu_tests.log" | tail -n 15
tests_rc=${PIPESTATUS[0]}
echo "== pd-bench kv-offload ${bench[*]}"
"$py" -m benchmarks.cli kv-offload "${bench[@]}" --json "$log_dir/kv_offload.json" 2>&1 |
  tee "$log_dir/kv_offload.log"
bench_rc=${PIPESTATUS[0]}
echo "kv offload: tests exit code $tests_rc, benchmark exit code $bench_rc"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
