#!/usr/bin/env bash
# KV transfer over ucx on the lent 2-GPU machine (nvidia-h200-x2), one command:
#   bash benchmarks/scripts/gpu_transfer_check.sh     (carry .whl: ../shared/tools/gpu-wheels.sh fills it)
# Prefill process on GPU0, decode process on GPU1: one Llama-3-8B-shaped request of 8192 tokens
# (32 layers x 2 x 8 kv heads x 128 x 8192 tokens x 2 bytes = 1 GiB in bf16) is packed per
# layer, moved over UCX (cuda_ipc over NVLink, GPU memory in place) and unpacked into other
# block ids, checked byte for byte, and timed end to end against a torch GPU0 -> GPU1 copy of
# the same bytes. Three UCX progress settings, so one run answers which suits the GPU path:
#   A  ucxx progress thread, request futures (pdserve's default: idle nodes stay idle)
#   B  the progress thread polls (a busy core; lowest latency)
#   C  progress on the event loop, requests polled from it (busy while anything is pending)
# Logs go to $OUT (the device tool's output folder) or /tmp. Exits within ~3 minutes: 0 when
# every transfer of run A landed byte-exact, 1 when not, 2 when the setup failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
log_dir="${OUT:-/tmp}"
log="$log_dir/gpu_transfer.log"
: >"$log"

fail_setup() { echo "gpu_transfer_check: $*" | tee -a "$log" >&2; exit 2; }

ls .whl/*.whl >/dev/null 2>&1 ||
  fail_setup "no wheels in .whl/: run ../shared/tools/gpu-wheels.sh in the repo, carry .whl"
SITE=$(mktemp -d)
timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl \
  >>"$log" 2>&1 || fail_setup "installing .whl/*.whl into $SITE failed (see $log)"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -n 3
echo "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-} UCX_TLS=${UCX_TLS:-} CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-}"
timeout 90 python3 -c '
import torch, ucxx
print("torch", torch.__version__, "| ucxx", ucxx.__version__, "| ucx", ucxx.__ucx_version__,
      "| GPUs", torch.cuda.device_count())
assert torch.cuda.device_count() >= 2, "this check needs two GPUs"
' 2>&1 | tee -a "$log" | grep -v '^\[' || fail_setup "torch/ucxx do not import, or fewer than 2 GPUs"

bench=(python3 -m benchmarks.cli transfer --transport ucx --device cuda --model llama3-8b
       --prompt-tokens 8192)

# run NAME LIMIT_S [VAR=VALUE ...] -- ARGS: one benchmark run; its table on stdout, all in the log
run() {
  local name=$1 limit_s=$2; shift 2
  local env_vars=()
  while [ "$1" != "--" ]; do env_vars+=("$1"); shift; done
  shift
  echo
  echo "== $name (${env_vars[*]:-defaults})" | tee -a "$log"
  env "${env_vars[@]}" timeout -k 10 "$limit_s" "${bench[@]}" "$@" >"$log_dir/run.out" 2>&1
  local rc=$?
  cat "$log_dir/run.out" >>"$log"
  grep -v '^\[' "$log_dir/run.out" | grep -v '^ *$' | tail -n 14
  [ "$rc" -eq 124 ] && echo "(timed out after ${limit_s}s)"
  echo "exit code: $rc"
  return "$rc"
}

run "A: progress thread + futures" 75 UCX_PROTO_INFO=y -- --iters 5
rc_a=$?
echo "UCX protocols chosen for CUDA memory in run A (rendezvous rows):"
grep -A8 'tagged message by ucp_tag_send\* from cuda' "$log_dir/run.out" |
  grep -E 'rendezvous|cuda_ipc|cuda_copy' | sed 's/^\[[^]]*\] *\[[^]]*\] *//' | sort -u | head -n 8
run "B: polling progress thread" 45 UCXPY_PROGRESS_MODE=thread-polling -- --iters 3
run "C: progress on the event loop" 45 UCXPY_PROGRESS_MODE=blocking UCXPY_ENABLE_PYTHON_FUTURE=0 -- --iters 3
rm -f "$log_dir/run.out"
echo
echo "gpu_transfer_check: run A exit code $rc_a (log: $log)"
exit "$rc_a"
