#!/usr/bin/env bash
# Issue 35: tensor parallelism on two GPUs, one command (nvidia-h100-x2 or nvidia-h200-x2):
#   bash benchmarks/scripts/gpu2_tp_check.sh
#   DRY_RUN=1 bash benchmarks/scripts/gpu2_tp_check.sh      (the same steps, tiny, on CPU, gloo)
# 1. tests/gpu/test_tp_gpu.py: TP 2 == TP 1 (tokens; logits in fp32), the all-reduce captured in
#    the decode CUDA graphs, a killed rank fails the engine, NCCL all_reduce inside a graph.
# 2. pd-bench engine, synthetic:llama3-8b bf16, decode at batch 1/32/128 (context 1K) and a 4K
#    prefill, TP 1 on GPU0 then TP 2 on GPU0+1 (collectives' share, step broadcast per step).
# 3. the target: TP 2 decode tokens/s at batch 32 >= 1.7x TP 1's (printed; exit 1 when below).
# Output in $OUT (or /tmp). Exit 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
log_dir="${OUT:-/tmp}"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if [ "${DRY_RUN:-0}" = 1 ]; then
  engine=(--device cpu --dtype float32 --model synthetic:tiny-llama --floor-model ''
          --batch-sizes 1,4 --contexts 64 --prefill-lens 128 --steps 4 --warmup-steps 1
          --bandwidth-bytes 64MiB --gemm-size 256)
  batch=4
  gpu_tests=0
else
  engine=(--device cuda --dtype bfloat16 --model synthetic:llama3-8b --floor-model ''
          --batch-sizes 1,32,128 --contexts 1024 --prefill-lens 4096)
  batch=32
  gpu_tests=1
fi
rc=0
if [ "$gpu_tests" = 1 ]; then
  echo "== tests/gpu/test_tp_gpu.py"
  timeout -k 10 1200 "$py" -m pytest tests/gpu/test_tp_gpu.py -q -x 2>&1 | tee "$log_dir/gpu2_tp_tests.out"
  st=${PIPESTATUS[0]}; echo "exit code: $st"; [ "$st" = 0 ] || rc=1
fi
for tp in 1 2; do
  echo "== pd-bench engine ${engine[*]} --tensor-parallel-size $tp"
  timeout -k 10 1800 "$py" -m benchmarks.cli engine "${engine[@]}" --tensor-parallel-size "$tp" \
    --json "$log_dir/gpu2_tp$tp.json" 2>"$log_dir/gpu2_tp$tp.err" | tee "$log_dir/gpu2_tp$tp.out"
  st=${PIPESTATUS[0]}; echo "exit code: $st"; [ "$st" = 0 ] || rc=1
done
echo "== TP 2 / TP 1 decode tokens/s at batch $batch"
"$py" - "$log_dir/gpu2_tp1.json" "$log_dir/gpu2_tp2.json" "$batch" "${DRY_RUN:-0}" <<'PY' || rc=1
import json, sys
one, two, batch, dry = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
def step_s(path):
    rows = json.load(open(path))["rows"]
    (row,) = [r for r in rows if f"decode batch {batch} ctx" in r["case"]]
    return row["value"]
t1, t2 = step_s(one), step_s(two)
ratio = t1 / t2  # tokens/s ratio: the same batch per step
print(f"batch {batch}: TP 1 {t1 * 1e3:.3f} ms/step ({batch / t1:.0f} tok/s), "
      f"TP 2 {t2 * 1e3:.3f} ms/step ({batch / t2:.0f} tok/s): {ratio:.2f}x (target >= 1.7x)")
sys.exit(0 if dry or ratio >= 1.7 else 1)
PY
echo "gpu2_tp_check: exit $rc (logs in $log_dir)"
exit "$rc"
