#!/usr/bin/env bash
# Issue 39: what the KV hand-off's frame MACs cost on the GPU, one command (one H100/H200; carry
# .whl as gpu_kv_check.sh says, for the routers' grpc):
#   bash benchmarks/scripts/gpu_mac_check.sh                      -> $OUT/mac_*.txt
#   MODES="sent" bash benchmarks/scripts/gpu_mac_check.sh         (a part: see MODES below)
#   DRY_RUN=1 bash benchmarks/scripts/gpu_mac_check.sh            (the same steps, tiny, on CPU)
# 1. pd-bench mac --device cuda: the keyed device digest (Triton and torch) of one llama3-8b
#    layer at 2K and 8K tokens against a device copy of the same bytes, a sender's whole cost
#    per message (digest, its copy to the host, the event, the tag), and the host MACs.
# 2. pd-bench ttft, synthetic:llama3-8b bf16, 1P1D on the one GPU against colocated, 2K and 8K,
#    without and with a cluster secret (--cluster-secret-file), per mode in MODES:
#      sent      writes in place off (pd-serve's `--no-kv-write-in-place`): layers
#                sent over ucx from GPU memory, MACed through their
#                device digest (the path two GPUs take)
#      inplace   the default on one GPU: layers written in place, only headers MACed
#      tcp       (not in the default MODES) --transport tcp: packed into pinned host staging,
#                MACed on the host (Poly1305) at both ends
#    Target: the secret's TTFT within 1 % of the open cluster's (compare the two 1P1D rows of a
#    mode; the 2nd-token column shows what the decode node's checks add).
# Budget: ~3-4 minutes per ttft run (4 by default): run MODES=sent and MODES=inplace as two
# calls if one call is limited to 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp}"
export PYTHONUNBUFFERED=1
modes=(${MODES:-sent inplace})
if [ "${DRY_RUN:-0}" = 1 ]; then
  py=${PYTHON:-python3}
  mac=(--device cpu --prompt-tokens 256 --iters 2)
  ttft=(--model synthetic:tiny-llama --device cpu --dtype float32 --transport tcp --requests 2
        --warmup 1 --prompt-tokens 64 256)
else
  py=python3
  if ls .whl/*.whl >/dev/null 2>&1; then
    SITE=$(mktemp -d)
    timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl ||
      { echo "gpu_mac_check: installing .whl failed"; exit 2; }
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  mac=(--device cuda --prompt-tokens 2048 8192 --iters 10)
  ttft=(--model synthetic:llama3-8b --dtype bfloat16 --device cuda --transport ucx --requests 7
        --warmup 2 --prompt-tokens 2048 8192)
fi
secret=$(mktemp)
"$py" -c "import secrets; print(secrets.token_hex(32))" >"$secret"
rc=0
echo "== pd-bench mac ${mac[*]}"
timeout -k 10 300 "$py" -m benchmarks.cli mac "${mac[@]}" 2>"$out/mac_bench.err" | tee "$out/mac_bench.txt"
st=${PIPESTATUS[0]}; echo "exit code: $st"; [ "$st" = 0 ] || rc=1
for mode in "${modes[@]}"; do
  extra=(--serve-arg=--http-port=0)
  [ "$mode" = sent ] && extra+=(--serve-arg=--no-kv-write-in-place)
  [ "$mode" = tcp ] && extra+=(--serve-arg=--no-kv-write-in-place --transport tcp)
  for auth in open secret; do
    flags=("${extra[@]}")
    [ "$auth" = secret ] && flags+=("--serve-arg=--cluster-secret-file=$secret")
    name="mac_ttft_${mode}_${auth}"
    echo "== pd-bench ttft ${ttft[*]} ${flags[*]}"
    timeout -k 10 540 "$py" -m benchmarks.cli ttft "${ttft[@]}" "${flags[@]}" \
      >"$out/$name.log" 2>&1
    st=$?
    grep -v '^\[' "$out/$name.log" | tee "$out/$name.txt" | tail -n 40
    echo "exit code: $st"; [ "$st" = 0 ] || rc=1
  done
done
rm -f "$secret"
echo "gpu_mac_check: exit $rc (logs in $out)"
exit "$rc"
