#!/usr/bin/env bash
# The FP8 KV cache (issue 40 item 1, --kv-cache-dtype fp8_e4m3) on the lent GPU machine:
#   bash benchmarks/scripts/gpu_fp8_kv_check.sh
#     1. tests: tests/gpu/test_fp8_kv_gpu.py (graph replay == eager, compiled Triton vs torch
#        over FP8 blocks, fused write byte-exact), the Triton FP8 unit tests compiled, the FP8
#        hand-off tests (bytes halved, byte-exact, the dtype refusal)
#     2. pd-bench engine, synthetic:llama3-8b bf16, decode batch 64 at ctx 4K: bf16 KV, then FP8
#        KV; the step-time ratio (target fp8 <= 0.75x bf16)
#     3. the largest batch each KV dtype holds at ctx 4K (the pool's blocks after the weights,
#        default --gpu-memory-utilization; 4096 + 1 tokens per request)
#     4. pd-bench fp8-kv on synthetic:llama3-8b:layers=4 bf16, seeded random prompts: greedy
#        agreement and mean KL of FP8 KV against bf16 KV
#     5. pd-bench transfer, 8192 tokens of llama3-8b KV over ucx (tcp where ucxx is missing),
#        bf16 then fp8_e4m3: bytes moved and byte-exact
#   DRY_RUN=1 bash benchmarks/scripts/gpu_fp8_kv_check.sh   the same on a CPU, tiny shapes (the
#     GPU tests skip); PYTHON picks the interpreter (default python3)
# Writes logs and JSON to $OUT when set (the device tool's output folder). Budget: ~6 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
out="${OUT:-/tmp}"
mkdir -p "$out"
if [ "${DRY_RUN:-0}" = 1 ]; then
  model=synthetic:tiny-llama quality_model=synthetic:tiny-llama context=64 batch=4
  engine=(--device cpu --dtype float32 --floor-model "" --prefill-lens "" --steps 2 --warmup-steps 1
    --bandwidth-bytes 64MiB --gemm-size 256)
  quality=(--device cpu --dtype float32 --num-prompts 4 --max-tokens 4)
  transfer=(--transport tcp --device cpu --model llama3-8b:layers=2 --prompt-tokens 256 --iters 1)
  device=cpu dtype=float32 budget=(--kv-cache-memory 64MiB)
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  model=synthetic:llama3-8b quality_model=synthetic:llama3-8b:layers=4 context=4096 batch=64
  engine=(--device cuda --dtype bfloat16 --floor-model "" --prefill-lens "")
  quality=(--device cuda --dtype bfloat16 --num-prompts 200 --max-tokens 16)
  transport=tcp; "$py" -c "import ucxx" 2>/dev/null && transport=ucx
  transfer=(--transport "$transport" --device cuda --model llama3-8b --prompt-tokens 8192 --iters 5)
  device=cuda dtype=bfloat16 budget=()
fi
rc=0
echo "== 1. tests"
"$py" -m pytest tests/gpu/test_fp8_kv_gpu.py tests/unit/kernels/attention/test_triton_fp8_kv.py \
  tests/unit/cache_transfer/test_fp8_handoff.py -q -p no:cacheprovider -o addopts="" -rs 2>&1 |
  tee "$out/fp8_kv_tests.log" | tail -n 15
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
echo "== 2. pd-bench engine --model $model --batch-sizes $batch --contexts $context (bf16 KV, then fp8)"
for kv in auto fp8_e4m3; do
  "$py" -m benchmarks.cli engine --model "$model" --batch-sizes "$batch" --contexts "$context" \
    "${engine[@]}" --kv-cache-dtype "$kv" --json "$out/fp8_kv_engine_$kv.json" 2>&1 |
    grep -v '^\[' | tee "$out/fp8_kv_engine_$kv.log" | tail -n 12
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
"$py" - "$out/fp8_kv_engine_auto.json" "$out/fp8_kv_engine_fp8_e4m3.json" <<'PY' || rc=1
import json, sys
def step_ms(path):  # the first decode row's value: seconds per step
    rows = [r for r in json.load(open(path))["rows"] if "decode" in r["case"]]
    return rows[0]["value"] * 1e3
bf16, fp8 = (step_ms(p) for p in sys.argv[1:])
print(f"decode step: bf16 KV {bf16:.3f} ms, fp8 KV {fp8:.3f} ms, ratio {fp8 / bf16:.3f} (target <= 0.75)")
PY
echo "== 3. the largest batch at ctx $context per KV dtype"
"$py" - "$model" "$device" "$dtype" "$context" "${budget[@]}" <<'PY' || rc=1
import sys
from engine.engine_core import EngineCore
from pdserve.config import EngineConfig
from pdserve.knobs import parse_size
model, device, dtype, context = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
extra = {"kv_cache_memory": parse_size(sys.argv[6])} if len(sys.argv) > 6 else {}
for kv in ("auto", "fp8_e4m3"):
    core = EngineCore(EngineConfig.from_kwargs(model=model, device=device, dtype=dtype,
                      kv_cache_dtype=kv, max_model_len=context + 64, enforce_eager=True, **extra))
    per_request = -(-(context + 1) // core.pool.block_size)
    print(f"kv {kv:>9}: {core.pool.num_blocks} blocks of {core.pool.block_size} tokens "
          f"({core.pool.num_bytes / 2**30:.2f} GiB) -> largest batch at ctx {context}: "
          f"{core.pool.num_blocks // per_request}")
    core.close()
    del core
PY
echo "== 4. pd-bench fp8-kv --model $quality_model"
"$py" -m benchmarks.cli fp8-kv --model "$quality_model" "${quality[@]}" --json "$out/fp8_kv_quality.json" 2>&1 |
  grep -v '^\[' | tee "$out/fp8_kv_quality.log" | tail -n 10
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
echo "== 5. pd-bench transfer ${transfer[*]}: bf16 KV, then fp8"
for kv in bfloat16 fp8_e4m3; do
  timeout -k 10 180 "$py" -m benchmarks.cli transfer "${transfer[@]}" --dtype "$kv" 2>&1 |
    grep -v '^\[' | tee "$out/fp8_kv_transfer_$kv.log" | tail -n 12
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
echo "fp8 kv check: exit code $rc"
exit $rc
