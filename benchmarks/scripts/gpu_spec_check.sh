#!/usr/bin/env bash
# Speculative decoding on the lent GPU machine (torch + triton there; no install needed):
#   bash benchmarks/scripts/gpu_spec_check.sh          every section below, in order
#   GPU_CHECKS="verify" bash benchmarks/scripts/gpu_spec_check.sh     only those sections
#   DRY_RUN=1 bash benchmarks/scripts/gpu_spec_check.sh    the same commands on CPU, tiny
#                                                       shapes: checks the script, no GPU
# Sections:
#   tests        python3 -m pytest tests/gpu/test_spec_decode_gpu.py tests/gpu/test_cuda_graphs.py
#                tests/gpu/test_attention_gpu.py (verify kernels, verify graphs vs eager,
#                speculative greedy vs plain greedy; the decode suites the kernel change touches)
#   verify       pd-bench engine --num-speculative-tokens 4: llama3-8b bf16 triton, a K=4 verify
#                step beside a plain decode step at batch 1, 8, 32, context 1K (plain decode with
#                async scheduling, the CUDA default; a verify step waits for its tokens).
#                Target: verify <= 1.15x decode at batch 1
#   verify_sync  the same with --async-scheduling off: both synchronous (the kernels' cost alone)
# Writes logs to $OUT when set (the device tool's output folder).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log_dir="${OUT:-/tmp}"
mkdir -p "$log_dir"
checks=" ${GPU_CHECKS:-tests verify verify_sync} "
want() { [[ "$checks" == *" $1 "* ]]; }
if [ "${DRY_RUN:-0}" = 1 ]; then
  engine_args=(--device cpu --dtype float32 --model synthetic:tiny-llama --floor-model ''
    --batch-sizes 1,4 --contexts 64 --prefill-lens '' --steps 3 --warmup-steps 1
    --bandwidth-bytes 64MiB --gemm-size 256)
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  engine_args=(--model synthetic:llama3-8b --dtype bfloat16 --attention-backend triton
    --batch-sizes 1,8,32 --contexts 1024 --prefill-lens '' --floor-model '')
fi
python3 -c 'import torch; print("torch", torch.__version__)'
tests_rc=0
if want tests; then
  python3 -m pytest tests/gpu/test_spec_decode_gpu.py tests/gpu/test_cuda_graphs.py \
    tests/gpu/test_attention_gpu.py -q -p no:cacheprovider -o addopts="" -rs 2>&1 |
    tee "$log_dir/gpu_spec_tests.log" | tail -n 25
  tests_rc=${PIPESTATUS[0]}
fi
bench_rc=0
if want verify; then
  echo "== pd-bench engine ${engine_args[*]} --num-speculative-tokens 4"
  python3 -m benchmarks.cli engine "${engine_args[@]}" --num-speculative-tokens 4 \
    --json "$log_dir/engine_verify.json" 2>&1 | tee "$log_dir/bench_engine_verify.log"
  bench_rc=$((bench_rc | PIPESTATUS[0]))
fi
if want verify_sync; then
  echo "== pd-bench engine ${engine_args[*]} --num-speculative-tokens 4 --async-scheduling off"
  python3 -m benchmarks.cli engine "${engine_args[@]}" --num-speculative-tokens 4 \
    --async-scheduling off --json "$log_dir/engine_verify_sync.json" 2>&1 |
    tee "$log_dir/bench_engine_verify_sync.log"
  bench_rc=$((bench_rc | PIPESTATUS[0]))
fi
exit $((tests_rc | bench_rc))
