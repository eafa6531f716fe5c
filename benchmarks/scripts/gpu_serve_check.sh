#!/usr/bin/env bash
# Issue 10 on the lent H200 (one GPU): pd-bench compare, 1P1D (both nodes on the one GPU) against
# colocated (one node), synthetic:llama3-8b bf16, ShareGPT requests from the committed sample
# (benchmarks/data/sharegpt_smollm2_500.jsonl, token ids), 100 prompts x 4 rates, --ignore-eos.
#   carry .whl made by: ../shared/tools/gpu-wheels.sh grpcio==1.85.1 protobuf==7.35.1 \
#     grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1
#   (the image's grpcio 1.84 is older than the generated stubs need; the routers run with
#   --http-port 0, so the FastAPI stack, absent there, is not needed)
#   (the nodes need pyzmq or ucxx for the KV transport, redis for pdserve.registry, and the
#   router/nodes grpc_health + grpc_reflection, which the GPU image lacks)
#   bash benchmarks/scripts/gpu_serve_check.sh      -> $OUT/serve_compare.{txt,json,png}, cluster logs
# RATES, NUM_PROMPTS, KV_TRANSPORT (default auto) override. Budget: ~6 minutes.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-/tmp}"
if ls .whl/*.whl >/dev/null 2>&1; then
  SITE=$(mktemp -d)
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl ||
    { echo "gpu_serve_check: installing .whl failed"; exit 2; }
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout -k 10 330 python3 -m benchmarks.cli compare --configs 1P1D,colocated:1 \
  --model synthetic:llama3-8b --dtype bfloat16 --device cuda --kv-transport "${KV_TRANSPORT:-auto}" \
  --dataset jsonl --dataset-path benchmarks/data/sharegpt_smollm2_500.jsonl \
  --num-prompts "${NUM_PROMPTS:-100}" --request-rate "${RATES:-2,4,8,16}" --ignore-eos \
  --max-output-tokens 512 --slo-ttft-ms 250 --slo-tpot-ms 25 --no-progress \
  --json "$out/serve_compare.json" --plot "$out/serve_compare.png" \
  --cluster-log "$out/cluster.log" --cluster-timeout-s 120 --http-port 0 2>&1 | tee "$out/serve_compare.txt"
exit "${PIPESTATUS[0]}"
