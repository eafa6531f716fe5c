"""Where pd-serve's nodes run: `num_gpus` (the GPUs visible) and `node_devices` (each node's
--device or, tensor-parallel, --devices, and how many ranks share a GPU)."""

from __future__ import annotations

import shutil
import subprocess

from pdserve import envs


def num_gpus() -> int:
    """The GPUs the nodes may use: CUDA_VISIBLE_DEVICES's, else nvidia-smi's (0: none)."""
    visible = envs.cuda_visible_devices()
    if visible is not None:
        return len(visible)
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU "))


def node_devices(
    device: str, num_prefill: int, num_decode: int, num_gpus: int, prefill_tp: int = 1,
    decode_tp: int = 1,
) -> tuple[dict[str, list[str]] | None, int]:  # fmt: skip
    """Where each node runs, and how many ranks share a GPU at most (each node gets that share
    of --gpu-memory-utilization). With `--device auto|cuda` and GPUs visible the nodes are
    spread over the visible GPUs by index, prefill nodes first (1P1D on 2 GPUs: prefill on
    cuda:0, decode on cuda:1), a node of tensor-parallel size N on N consecutive GPUs
    ("cuda:0,cuda:1": its --devices), each told its devices; CUDA_VISIBLE_DEVICES is left as
    the user set it, so every node sees every listed GPU (UCX's cuda_ipc maps a peer's memory
    only when its GPU is visible). `None`: nodes keep the given --device (cpu, or one
    cuda:N). ValueError when a node needs more GPUs than there are."""
    num_nodes = num_prefill + num_decode
    if device not in ("auto", "cuda") or num_gpus == 0:
        shared = device.startswith("cuda")
        return None, (num_nodes if shared else 1)
    order = [("prefill", prefill_tp)] * num_prefill + [("decode", decode_tp)] * num_decode
    devices: dict[str, list[str]] = {"prefill": [], "decode": []}
    ranks_on = [0] * num_gpus
    slot = 0
    for role, tp in order:
        if tp > num_gpus:
            raise ValueError(
                f"a {role} node of tensor-parallel size {tp} needs {tp} GPUs; {num_gpus} visible"
            )
        gpus = [(slot + r) % num_gpus for r in range(tp)]
        for gpu in gpus:
            ranks_on[gpu] += 1
        devices[role].append(",".join(f"cuda:{g}" for g in gpus))
        slot += tp
    return devices, max(ranks_on)
