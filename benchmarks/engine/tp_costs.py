"""What tensor parallelism costs a decode step, on rank 0 (`pd-bench engine
--tensor-parallel-size N`):

```
step broadcast   rank 0's time in TensorParallel.send_step: handing the step's inputs to the
                 other ranks (the shared-memory broadcast; with async scheduling also the
                 previous step's ids, a device broadcast)
collectives      CPU (gloo, synchronous): host time inside every all-reduce / gather /
                 broadcast call of the step; CUDA: the NCCL kernels' time in a profiled run of
                 the same steps (they run inside the decode graphs, no Python around them)
```

Both include waiting for the slowest rank: a collective ends when every rank reached it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from engine.engine_core import EngineCore

_COLLECTIVES = ("all_reduce", "gather_to_first", "broadcast")


@dataclass
class TPCosts:
    """Seconds per step on rank 0."""

    step_s: float
    broadcast_s: float
    collectives_s: float

    @property
    def collective_share(self) -> float:
        return self.collectives_s / self.step_s if self.step_s else 0.0


@contextmanager
def host_timers(core: EngineCore) -> Iterator[dict[str, float]]:
    """Time rank 0's send_step, and (on CPU) its collectives, while inside: seconds summed under
    "broadcast" and "collectives"."""
    tp = core.tp
    assert tp is not None
    totals = {"broadcast": 0.0, "collectives": 0.0}
    patched: list[tuple[Any, str]] = [(tp, "send_step")]
    if tp.device.type == "cpu":
        patched += [(tp.comm, name) for name in _COLLECTIVES]
    for owner, name in patched:
        key = "broadcast" if name == "send_step" else "collectives"
        setattr(owner, name, _timed(getattr(owner, name), totals, key))
    try:
        yield totals
    finally:
        for owner, name in patched:
            delattr(owner, name)  # the class's method again


def _timed(fn: Callable[..., Any], totals: dict[str, float], key: str) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start

    return wrapped


def nccl_seconds(run_steps: Callable[[], None], num_steps: int) -> float:
    """CUDA: the NCCL kernels' device time per step while `run_steps` runs `num_steps`."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_steps()
        torch.cuda.synchronize()
    total_us = 0.0
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and "nccl" in event.key.lower():
            value = getattr(event, "self_device_time_total", None)
            total_us += float(value if value is not None else event.self_cuda_time_total)
    return total_us / 1e6 / num_steps


def measure(core: EngineCore, run_steps: Callable[[int], None], steps: int) -> TPCosts:
    """Run `steps` decode steps timed (the step, its broadcast, on CPU its collectives), then on
    CUDA `steps` more under the profiler for the NCCL kernels' time."""
    with host_timers(core) as totals:
        start = time.perf_counter()
        run_steps(steps)
        step_s = (time.perf_counter() - start) / steps
    collectives_s = totals["collectives"] / steps
    if core.device.type == "cuda":
        collectives_s = nccl_seconds(lambda: run_steps(steps), steps)
    return TPCosts(step_s, totals["broadcast"] / steps, collectives_s)


def format_table(info: dict[str, Any]) -> str:
    """`pd-bench engine`'s second table: tensor parallelism's cost per decode step, on rank 0."""
    if not info.get("tp"):
        return ""
    lines = [
        f"\n\ntensor parallel size {info['tensor_parallel_size']}: per decode step on rank 0",
        "| case | step | collectives (share) | step broadcast |", "|---|---|---|---|",
    ]  # fmt: skip
    lines += [
        f"| {c['case']} | {c['step_s'] * 1e3:.3f} ms | {c['collectives_s'] * 1e3:.3f} ms "
        f"({c['collective_share']:.0%}) | {c['broadcast_s'] * 1e6:.0f} us |"
        for c in info["tp"]
    ]
    return "\n".join(lines)
