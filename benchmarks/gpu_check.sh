#!/usr/bin/env bash
# The whole GPU check, for the lent GPU machine (torch + triton there; no install needed):
#   bash benchmarks/gpu_check.sh            GPU tests, the attention table, the pd-bench engine table,
#                                           pd-bench profile (llama3-8b, smollm2-135m)
#   WITH_FA=1 bash benchmarks/gpu_check.sh  builds flash-attn first (carry .fa, see
#                                           ../shared/tools/flash-attn-prepare.sh; ~4-8 min)
# Writes logs to $OUT when set (the device tool's output folder).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # grpcio/pyzmq/ucxx for the two-process tests (gpu_serve_check.sh)
  SITE=$(mktemp -d)
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl ||
    { echo "gpu_check: installing .whl failed"; exit 2; }
  export PYTHONPATH="$SITE:$PYTHONPATH"
fi
log_dir="${OUT:-/tmp}"
if [ "${WITH_FA:-0}" = 1 ]; then
  bash .fa/build.sh && export PYTHONPATH="$HOME/fa/src:$PYTHONPATH"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
python3 -m pytest tests/gpu -q -p no:cacheprovider -o addopts="" 2>&1 | tee "$log_dir/gpu_tests.log" | tail -n 25
tests_rc=${PIPESTATUS[0]}
python3 -m benchmarks.bench_attention --iters 20 2>&1 | tee "$log_dir/bench_attention.log"
python3 -m benchmarks.cli engine --attention-backend triton --json "$log_dir/engine_triton.json" \
  2>&1 | tee "$log_dir/bench_engine_triton.log"
# Where a decode step's time goes: host phases, kernels per step (graphs, then eager).
python3 -m benchmarks.cli profile --model synthetic:llama3-8b --attention-backend triton \
  --batch-sizes 1,32,128 --json "$log_dir/profile_llama3_8b.json" 2>&1 | tee "$log_dir/profile_llama3_8b.log"
python3 -m benchmarks.cli profile --model synthetic:smollm2-135m --attention-backend triton \
  --batch-sizes 1,32 --json "$log_dir/profile_smollm2.json" 2>&1 | tee "$log_dir/profile_smollm2.log"
python3 -m benchmarks.cli profile --model synthetic:smollm2-135m --attention-backend triton \
  --batch-sizes 1 --enforce-eager --json "$log_dir/profile_smollm2_eager.json" 2>&1 \
  | tee "$log_dir/profile_smollm2_eager.log"
if [ "${WITH_FA:-0}" = 1 ]; then
  python3 -m benchmarks.cli engine --attention-backend flash_attn \
    --json "$log_dir/engine_flash_attn.json" 2>&1 | tee "$log_dir/bench_engine_flash_attn.log"
fi
echo "gpu tests exit code: $tests_rc"
exit "$tests_rc"
