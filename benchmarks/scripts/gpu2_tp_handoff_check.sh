#!/usr/bin/env bash
# Issue 35: KV hand-offs between tensor-parallel sizes on two GPUs, one command
# (nvidia-h100-x2 or nvidia-h200-x2; carry .whl for ucx):
#   bash benchmarks/scripts/gpu2_tp_handoff_check.sh
#   DRY_RUN=1 bash benchmarks/scripts/gpu2_tp_handoff_check.sh   (the same steps, tiny, on CPU)
# 1. pd-bench transfer --src-tp 2 --dst-tp 1, llama3-8b shape bf16, 8K tokens, ucx: prefill rank
#    0 on GPU0 and rank 1 on GPU1, each sending its 4 kv heads straight to the decode process
#    (GPU0), byte-exact, beside a torch copy GPU0 -> GPU1 of the same bytes in the same run.
#    Target: the hand-off at >= 75% of that copy rate (exit 1 below it; not checked on CPU).
# 2. the same for TP 1 -> 2 and TP 2 -> 2 (printed, byte-exact checked, no rate target).
# Output in $OUT (or /tmp). Exit 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
log_dir="${OUT:-/tmp}"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if [ "${DRY_RUN:-0}" = 1 ]; then
  transfer=(--transport tcp --device cpu --model llama3-8b:layers=2 --prompt-tokens 256 --iters 1)
  target=0
else
  if ls .whl/*.whl >/dev/null 2>&1; then
    SITE=$(mktemp -d)
    timeout 120 "$py" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl ||
      { echo "gpu2_tp_handoff_check: installing .whl failed"; exit 2; }
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
  transfer=(--transport ucx --device cuda --model llama3-8b --prompt-tokens 8192 --iters 3)
  target=75
fi
rc=0
for sizes in "2 1" "1 2" "2 2"; do
  read -r src dst <<<"$sizes"
  out="$log_dir/gpu2_tp_handoff_${src}to${dst}.out"
  echo "== pd-bench transfer ${transfer[*]} --src-tp $src --dst-tp $dst"
  timeout -k 10 600 "$py" -m benchmarks.cli transfer "${transfer[@]}" --src-tp "$src" \
    --dst-tp "$dst" 2>"${out%.out}.err" | tee "$out"
  st=${PIPESTATUS[0]}; echo "exit code: $st"; [ "$st" = 0 ] || rc=1
  grep -q "byte-exact: OK" "$out" || rc=1
done
echo "== TP 2 -> TP 1 against the GPU-to-GPU copy rate of the same run (target >= ${target}%)"
"$py" - "$log_dir/gpu2_tp_handoff_2to1.out" "$target" <<'PY' || rc=1
import re, sys
text, target = open(sys.argv[1]).read(), int(sys.argv[2])
row = re.search(r"^prefill TP 2 -> decode TP 1.*?([\d.]+)\s+(\d+)%", text, re.M)
if row is None:
    sys.exit("no 'prefill TP 2 -> decode TP 1' row in the output")
print(f"TP 2 -> TP 1: {row.group(1)} GB/s, {row.group(2)}% of the copy rate (target >= {target}%)")
sys.exit(0 if int(row.group(2)) >= target else 1)
PY
echo "gpu2_tp_handoff_check: exit $rc (logs in $log_dir)"
exit "$rc"
