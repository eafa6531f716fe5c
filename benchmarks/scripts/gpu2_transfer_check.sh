#!/usr/bin/env bash
# Issue 12: the whole two-GPU KV hand-off check, one command (nvidia-h200-x2; carry .whl):
#   bash benchmarks/scripts/gpu2_transfer_check.sh
#   DRY_RUN=1 bash benchmarks/scripts/gpu2_transfer_check.sh     (the same steps, tiny, on CPU)
# 1. pd-bench transfer, llama3-8b shape, 8K and 32K tokens, prefill process on GPU0 and decode
#    process on GPU1 (both GPUs visible to both: cuda_ipc maps peer memory), byte-exact, with
#    the torch peer-copy and raw-ucxx ceilings of the same run.
# 2. pd-bench ttft 2K/8K/32K: 1P1D across GPUs (pd-serve: prefill cuda:0, decode cuda:1)
#    against colocated on GPU0 alone.
# Output in $OUT (or /tmp). Exit 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
log_dir="${OUT:-/tmp}"
export PYTHONUNBUFFERED=1
if [ "${DRY_RUN:-0}" = 1 ]; then
  py=${PYTHON:-python3}
  transfer=(--transport tcp --device cpu --model llama3-8b:layers=2 --iters 1)
  sizes=(128 256)
  ttft=(--model synthetic:tiny-llama --device cpu --transport tcp --requests 1 --prompt-tokens 32 64 96)
  two_gpu=""
  one_gpu=""
else
  py=python3
  if ls .whl/*.whl >/dev/null 2>&1; then
    SITE=$(mktemp -d)
    timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl ||
      { echo "gpu2_transfer_check: installing .whl failed"; exit 2; }
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
  transfer=(--transport ucx --device cuda --model llama3-8b --iters 3)
  sizes=(8192 32768)
  ttft=(--model synthetic:llama3-8b --dtype bfloat16 --transport ucx --requests 5
        --prompt-tokens 2048 8192 32768 --serve-arg=--max-model-len=33000)
  two_gpu="0,1"
  one_gpu="0"
fi
rc=0
for n in "${sizes[@]}"; do
  echo "== pd-bench transfer ${transfer[*]} --prompt-tokens $n"
  CUDA_VISIBLE_DEVICES=${two_gpu:-${CUDA_VISIBLE_DEVICES:-}} timeout -k 10 240 \
    "$py" -m benchmarks.cli transfer "${transfer[@]}" --prompt-tokens "$n" 2>"$log_dir/gpu2_transfer_$n.err" |
    tee "$log_dir/gpu2_transfer_$n.out"
  st=${PIPESTATUS[0]}; echo "exit code: $st"; [ "$st" = 0 ] || rc=1
  grep -q "byte-exact: OK" "$log_dir/gpu2_transfer_$n.out" || rc=1
done
# 1P1D across the GPUs vs colocated on one: pd-bench starts colocated then 1P1D; with two
# GPUs visible pd-serve puts prefill on cuda:0 and decode on cuda:1; the colocated node is
# the first on cuda:0 (--prefill 0 has one decode node only).
echo "== pd-bench ttft ${ttft[*]}"
CUDA_VISIBLE_DEVICES=${two_gpu:-${CUDA_VISIBLE_DEVICES:-}} timeout -k 10 1200 \
  "$py" -m benchmarks.cli ttft "${ttft[@]}" 2>"$log_dir/gpu2_ttft.err" | tee "$log_dir/gpu2_ttft.out"
st=${PIPESTATUS[0]}; echo "exit code: $st"; [ "$st" = 0 ] || rc=1
: "${one_gpu}"
echo "gpu2_transfer_check: exit $rc (logs in $log_dir)"
exit "$rc"
