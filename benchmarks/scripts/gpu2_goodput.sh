#!/usr/bin/env bash
# Issue 13: goodput of 1P1D (prefill node on GPU0, decode node on GPU1) against two colocated
# replicas (one per GPU) behind one router, synthetic:llama3-8b bf16, ShareGPT requests from
# benchmarks/data/sharegpt_smollm2_500.jsonl, SLO TTFT p90 <= 250 ms and TPOT p90 <= 25 ms
# (goodput counts requests meeting both; the JSON also holds every curve without SLOs).
# Both sides use --policy prefix_aware; the colocated side keeps its local prefill (it has no
# prefill node), the 1P1D side its default conditional disaggregation. pd-serve puts node i on
# GPU i % (visible GPUs), decode nodes first: 1P1D -> decode GPU0, prefill GPU1.
#   bash benchmarks/scripts/gpu2_goodput.sh             nvidia-h200-x2 (carry .whl, see gpu_serve_check.sh)
#   ONE_GPU=1 bash benchmarks/scripts/gpu2_goodput.sh   dry run, both configurations on one GPU
#   DRY_RUN=1 bash benchmarks/scripts/gpu2_goodput.sh   CPU, default model, tiny: checks the script runs
# Writes $OUT/goodput2.{txt,json,png} and the cluster logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp}"
PY="${PYTHON:-python3}"
if ls .whl/*.whl >/dev/null 2>&1 && [ "${DRY_RUN:-0}" != 1 ]; then
  SITE=$(mktemp -d)
  timeout 120 $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl ||
    { echo "gpu2_goodput: installing .whl failed"; exit 2; }
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
common=(--dataset jsonl --dataset-path benchmarks/data/sharegpt_smollm2_500.jsonl --ignore-eos
        --slo-ttft-ms 250 --slo-tpot-ms 25 --policy prefix_aware --no-progress
        --json "$out/goodput2.json" --plot "$out/goodput2.png" --cluster-log "$out/cluster.log"
        --http-port 0)  # the GPU image has no FastAPI stack; the benchmark speaks gRPC
if [ "${DRY_RUN:-0}" = 1 ]; then
  run=(--model smollm2-135m --device cpu --num-prompts 4 --max-output-tokens 4 --request-rate 4
       --num-warmups 0 --cluster-timeout-s 300)
  limit=600
else
  [ "${ONE_GPU:-0}" = 1 ] && export CUDA_VISIBLE_DEVICES=0
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  run=(--model synthetic:llama3-8b --dtype bfloat16 --device cuda --num-prompts "${NUM_PROMPTS:-100}"
       --max-output-tokens 512 --request-rate "${RATES:-4,8,12,16}" --cluster-timeout-s 180)
  limit=540
fi
timeout -k 10 "$limit" $PY -m benchmarks.cli compare --configs 1P1D,colocated:2 "${run[@]}" \
  "${common[@]}" 2>&1 | tee "$out/goodput2.txt"
exit "${PIPESTATUS[0]}"
