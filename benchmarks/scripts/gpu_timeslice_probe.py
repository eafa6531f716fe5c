"""Does small GPU work in a second process slow a long forward in the first? Two processes on
one GPU (no MPS) time-slice it; this puts a number on it (issue 9: a decode node that receives
KV layer by layer on the prefill node's own GPU).

    python3 -m benchmarks.scripts.gpu_timeslice_probe          (CUDA only; ~30 s)

Process A times 32 'layers' of 5 bf16 GEMMs [2048, 4096] x [4096, 4096] with CUDA events
(median of 5 after 2 warm-ups). Process B is idle, or every PERIOD_S puts an 8 MiB device copy
and a small index_select on the GPU and synchronizes (like one layer's receive + unpack).
Results: benchmarks/results/2026-12-02-h200-kv-handoff.txt (run 6)."""

import multiprocessing as mp
import statistics
import time

import torch

PERIOD_S = 0.002


def worker(mode: str, stop, ready) -> None:
    torch.cuda.init()
    x = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ids = torch.randint(0, 1000, (512,), device="cuda")
    z = torch.randn(1000, 4096, device="cuda")
    torch.cuda.synchronize()
    ready.set()
    n = 0
    while not stop.is_set():
        if mode == "busy":
            y.copy_(x)
            z.index_select(0, ids)
            torch.cuda.synchronize()
            n += 1
        time.sleep(PERIOD_S)


def forward_ms(reps: int = 7) -> float:
    a = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(5)]
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        h = a
        for _layer in range(32):
            for w in ws:
                h = (h @ w) * 0.01
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    for mode in ("idle", "busy", "idle", "busy"):
        stop, ready = ctx.Event(), ctx.Event()
        p = ctx.Process(target=worker, args=(mode, stop, ready))
        p.start()
        ready.wait(60)
        time.sleep(0.2)
        ms = forward_ms()
        stop.set()
        p.join(10)
        print(f"second process {mode:>4}: forward {ms:7.2f} ms (median)", flush=True)
