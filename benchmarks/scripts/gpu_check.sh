#!/usr/bin/env bash
# The whole GPU check, for the lent GPU machine (torch + triton there; no install needed):
#   bash benchmarks/scripts/gpu_check.sh            every section below, in order
#   GPU_CHECKS="tests engine" bash benchmarks/scripts/gpu_check.sh     only those sections
#   WITH_FA=1 bash benchmarks/scripts/gpu_check.sh  builds flash-attn first (carry .fa, see
#                                           ../shared/tools/flash-attn-prepare.sh; ~4-8 min)
# Sections:
#   tests        python3 -m pytest tests/gpu
#   attention    the attention microbenchmark (every backend present)
#   sweep        decode attention launch settings per batch and context (attention_split_sweep)
#   engine       pd-bench engine, llama3-8b bf16 triton, async scheduling (the default on CUDA)
#   engine_sync  the same decode rows with --async-scheduling off (what the overlap saves)
#   pdl          decode at batch 1-128 (the graph sizes) with PDSERVE_PDL=0 and =1, twice in turn (what
#                programmatic dependent launch saves: kernels/pdl.py)
#   profile      pd-bench profile: host phases and kernels per decode step
#   structured   structured outputs: compile time, TTFT with a cold and a cached schema, and a
#                decode step with every request under a JSON schema against unconstrained
#                (llama3-8b bf16, batch 32: benchmarks/engine/bench_structured.py)
# Writes logs to $OUT when set (the device tool's output folder).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # grpcio/pyzmq/ucxx for the two-process tests (gpu_serve_check.sh)
  SITE=$(mktemp -d)
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl ||
    { echo "gpu_check: installing .whl failed"; exit 2; }
  export PYTHONPATH="$SITE:$PYTHONPATH"
fi
log_dir="${OUT:-/tmp}"
checks=" ${GPU_CHECKS:-tests attention sweep engine engine_sync pdl profile structured} "
want() { [[ "$checks" == *" $1 "* ]]; }
if [ "${WITH_FA:-0}" = 1 ]; then
  bash .fa/build.sh && export PYTHONPATH="$HOME/fa/src:$PYTHONPATH"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
tests_rc=0
if want tests; then
  python3 -m pytest tests/gpu -q -p no:cacheprovider -o addopts="" -rs 2>&1 | tee "$log_dir/gpu_tests.log" | tail -n 25
  tests_rc=${PIPESTATUS[0]}
fi
if want attention; then
  python3 -m benchmarks.kernels.bench_attention --iters 20 2>&1 | tee "$log_dir/bench_attention.log"
fi
if want sweep; then
  timeout -k 10 240 python3 -m benchmarks.kernels.attention_split_sweep 2>&1 | tee "$log_dir/attention_sweep.log"
fi
engine_args=(--model synthetic:llama3-8b --dtype bfloat16 --attention-backend triton
  --batch-sizes 1,32,128 --contexts 1024)
if want engine; then
  echo "== pd-bench engine ${engine_args[*]} --prefill-lens 4096,8192 --floor-model synthetic:smollm2-135m"
  python3 -m benchmarks.cli engine "${engine_args[@]}" --json "$log_dir/engine_triton.json" \
    2>&1 | tee "$log_dir/bench_engine_triton.log"
fi
if want engine_sync; then
  echo "== pd-bench engine ${engine_args[*]} --prefill-lens '' --async-scheduling off"
  python3 -m benchmarks.cli engine "${engine_args[@]}" --prefill-lens '' --async-scheduling off \
    --json "$log_dir/engine_triton_sync.json" 2>&1 | tee "$log_dir/bench_engine_triton_sync.log"
fi
if want pdl; then
  pdl_batches=1,2,4,8,16,24,32,48,64,128
  for round in 1 2; do
    for flag in 0 1; do
      echo "== PDSERVE_PDL=$flag pd-bench engine ${engine_args[*]} --batch-sizes $pdl_batches (round $round)"
      PDSERVE_PDL=$flag python3 -m benchmarks.cli engine "${engine_args[@]}" --batch-sizes "$pdl_batches" \
        --prefill-lens '' --floor-model '' 2>&1 | tee -a "$log_dir/bench_engine_pdl.log" | grep -E "^\||PDL|ceilings"
    done
  done
fi
if want profile; then
  # Where a decode step's time goes: host phases, kernels per step (graphs, then eager).
  python3 -m benchmarks.cli profile --model synthetic:llama3-8b --attention-backend triton \
    --batch-sizes 1,32,128 --json "$log_dir/profile_llama3_8b.json" 2>&1 | tee "$log_dir/profile_llama3_8b.log"
  python3 -m benchmarks.cli profile --model synthetic:smollm2-135m --attention-backend triton \
    --batch-sizes 1,32 --json "$log_dir/profile_smollm2.json" 2>&1 | tee "$log_dir/profile_smollm2.log"
fi
if want structured; then
  python3 -m benchmarks.engine.bench_structured --dtype bfloat16 2>&1 | tee "$log_dir/bench_structured.log"
fi
if [ "${WITH_FA:-0}" = 1 ] && want engine; then
  python3 -m benchmarks.cli engine --attention-backend flash_attn \
    --json "$log_dir/engine_flash_attn.json" 2>&1 | tee "$log_dir/bench_engine_flash_attn.log"
fi
echo "gpu tests exit code: $tests_rc"
exit "$tests_rc"
