"""Tensor parallelism on two GPUs (NCCL): an all-reduce captured in a CUDA graph replays; TP 2
gives TP 1's tokens (fp32: and its logits) with the decode graphs (the all-reduces inside them)
and async scheduling (the previous step's ids broadcast on the device), eager too; bf16 runs
the Triton layer ops per rank; a killed rank fails the engine at once. Skipped without 2 GPUs.
benchmarks/scripts/gpu2_tp_check.sh runs this file."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from engine import LLM, SamplingParams
from engine.distributed import TPError
from engine.distributed.process_group import connect_store, create_store

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
    ),
]
MODEL = "synthetic:llama3-8b:layers=2"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(3, 300, (12,), generator=gen).tolist()
    out = [torch.randint(1000, 128000, (n,), generator=gen).tolist() for n in lengths]
    return out + [out[0][:200] + [7, 8, 9]]  # a prefix hit


def run(tp: int, dtype: str, enforce_eager: bool = False, **kwargs: Any):
    """(tokens per prompt, every logits tensor rank 0's sampler got)."""
    llm = LLM(MODEL, device="cuda", dtype=dtype, tensor_parallel_size=tp, num_blocks=256,
              enforce_eager=enforce_eager, max_num_seqs=16, max_model_len=1024, **kwargs)  # fmt: skip
    seen: list[torch.Tensor] = []
    launch = llm.engine.runner.sampler.launch

    def spy(logits: torch.Tensor, *args: Any, **kw: Any) -> Any:
        seen.append(logits.float().cpu())
        return launch(logits, *args, **kw)

    llm.engine.runner.sampler.launch = spy
    try:
        graphs = llm.engine.runner.decode_graphs
        assert graphs is not None and graphs.captured == (not enforce_eager)
        tokens = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
        llm.engine.check_no_leaks()
    finally:
        llm.close()
    return tokens, seen


def _graph_rank(rank: int, port: int, out: Any) -> None:
    torch.cuda.set_device(rank)
    store = connect_store(port, 2, timeout_s=60)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))  # fmt: skip
    x = torch.zeros(1024, device="cuda")
    dist.all_reduce(x)  # the communicator exists before the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        y = x * 2
        dist.all_reduce(y)
    torch.cuda.current_stream().wait_stream(stream)
    results = []
    for value in (1.0, 3.0):
        x.fill_(value * (rank + 1))
        graph.replay()
        torch.cuda.synchronize()
        results.append(float(y[0]))
    out.put((rank, results))
    dist.destroy_process_group()


def test_an_nccl_all_reduce_replays_inside_a_cuda_graph() -> None:
    store = create_store(2, timeout_s=60)  # here, on a port it bound: the ranks are clients
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_graph_rank, args=(r, store.port, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    # replay: 2 * (v * 1) + 2 * (v * 2) summed over the two ranks = 6 v
    assert results == {0: [6.0, 18.0], 1: [6.0, 18.0]}


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_tp2_gives_tp1_tokens_and_logits_in_fp32(enforce_eager: bool) -> None:
    tokens, logits = run(2, "float32", enforce_eager)
    want_tokens, want_logits = run(1, "float32", enforce_eager)
    assert tokens == want_tokens
    assert len(logits) == len(want_logits)
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=0)


def test_tp2_in_bf16_keeps_tp1_first_tokens_where_they_are_clear() -> None:
    """bf16 sums the partial projections in another order: compare the first sampled token of
    each request where TP 1's top two logits are at least 0.5 apart, and the logits loosely."""
    _, logits = run(2, "bfloat16")
    _, want_logits = run(1, "bfloat16")
    first, want = logits[0], want_logits[0]  # the prefill step's rows
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.5
    assert clear.sum() >= want.shape[0] // 2
    assert torch.equal(first.argmax(-1)[clear], want.argmax(-1)[clear])
    torch.testing.assert_close(first, want, atol=0.5, rtol=0.05)


def test_devices_name_each_ranks_gpu() -> None:
    tokens, _ = run(2, "float32", devices="cuda:1,cuda:0")
    want, _ = run(1, "float32")
    assert tokens == want


def test_a_rank_killed_mid_decode_fails_the_engine() -> None:
    llm = LLM(MODEL, device="cuda", dtype="bfloat16", tensor_parallel_size=2, num_blocks=256,
              max_model_len=1024, tp_step_timeout_s=30.0)  # fmt: skip
    (pid,) = llm.engine.tp.workers.pids
    llm.generate(prompts()[:2], GREEDY)
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    try:
        with pytest.raises(TPError, match=rf"rank 1 \(pid {pid}\) was killed by SIGKILL"):
            llm.generate(prompts()[:2], SamplingParams(temperature=0.0, max_tokens=200))
        assert time.monotonic() - start < 60
    finally:
        llm.close()
