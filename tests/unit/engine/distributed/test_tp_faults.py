"""A tensor-parallel rank that dies or hangs, at start or inside a step, fails the engine with
a clear TPError within a timeout, and no worker process is left behind."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence

import psutil
import pytest

from engine import LLM, SamplingParams
from engine.distributed import TPError
from engine.engine_core import EngineCore
from pdserve.config import EngineConfig
from tests.unit.engine.distributed.tp_models import failing_init, hanging_init

TINY = dict(model="synthetic:tiny-llama", device="cpu", dtype="float32", num_blocks=64)
PROMPT = [5, 6, 7, 8, 9, 10]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


def worker_pids() -> list[int]:
    """This process's tensor-parallel worker processes still alive (not zombies)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "engine.tp_worker" in " ".join(child.cmdline()):
                found.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def assert_no_worker_left(timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while worker_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not worker_pids(), "a tensor-parallel worker outlived its engine"


def kill_in_forward(llm: LLM, sig: signal.Signals) -> None:
    """Send `sig` to rank 1 from rank 0's layer hook: in the middle of a prefill step."""
    (pid,) = llm.engine.tp.workers.pids

    def hook(layer_idx: int, chunks: Sequence[object]) -> None:
        if layer_idx == 0:
            os.kill(pid, sig)

    llm.engine.on_layer_done = hook


def test_sizes_that_do_not_divide_are_refused_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match="9 attention heads, 3 kv heads.*Sizes that work: 1, 3"):
        LLM(**{**TINY, "model": "synthetic:smollm2-135m:layers=1"}, tensor_parallel_size=2)
    assert not worker_pids()


def test_the_host_kv_tier_is_refused_with_tensor_parallelism() -> None:
    with pytest.raises(ValueError, match="kv-offload-memory.*does not run with tensor paral"):
        LLM(**TINY, tensor_parallel_size=2, kv_offload_memory=1 << 20)
    assert not worker_pids()


def test_a_worker_killed_while_idle_fails_the_next_step() -> None:
    llm = LLM(**TINY, tensor_parallel_size=2)
    (pid,) = llm.engine.tp.workers.pids
    os.kill(pid, signal.SIGKILL)
    try:
        with pytest.raises(TPError, match=rf"rank 1 \(pid {pid}\) was killed by SIGKILL"):
            for _ in range(200):  # the watcher sees the death at once; the next step fails
                llm.generate([PROMPT], PARAMS)
                time.sleep(0.05)
    finally:
        llm.close()
    assert_no_worker_left()


@pytest.mark.parametrize(
    ("sig", "error"),
    [
        (signal.SIGKILL, r"rank 1 \(pid \d+\) was killed by SIGKILL"),
        (signal.SIGSTOP, r"failed or timed out \(a rank hangs past tp_step_timeout_s=2 s"),
    ],
)
def test_a_worker_that_dies_or_hangs_inside_a_step_fails_it(
    sig: signal.Signals, error: str
) -> None:
    llm = LLM(**TINY, tensor_parallel_size=2, tp_step_timeout_s=2.0)
    kill_in_forward(llm, sig)
    start = time.monotonic()
    try:
        with pytest.raises(TPError, match=error):
            llm.generate([PROMPT], PARAMS)
        assert time.monotonic() - start < 60
        with pytest.raises(TPError):  # the engine stays failed
            llm.generate([PROMPT], PARAMS)
    finally:
        llm.close()
    assert_no_worker_left()


@pytest.mark.parametrize(
    ("worker_init", "start_timeout_s", "error"),
    [
        (failing_init, 600.0, "RuntimeError: worker_init failed on purpose"),
        # the hang is in worker_init; on a loaded machine the start itself may already take
        # longer than the timeout: either way the start times out
        (hanging_init, 10.0, "failed or timed out|did not start within 10 s"),
    ],
)
def test_a_worker_that_fails_or_hangs_at_start_fails_the_engine(
    worker_init: Callable[[object], None], start_timeout_s: float, error: str
) -> None:
    config = EngineConfig.from_kwargs(
        **TINY, tensor_parallel_size=2, tp_start_timeout_s=start_timeout_s
    )
    with pytest.raises(TPError, match=error):
        EngineCore(config, worker_init=worker_init)
    assert_no_worker_left()
