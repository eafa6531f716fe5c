"""pd-bench engine: the engine's decode step, prefill rate and per-step floor, each beside the
ceiling measured in the same run.

    pd-bench engine [--model synthetic:llama3-8b] [--dtype bfloat16] [--batch-sizes 1,8,32,128]
                    [--contexts 1024,4096] [--prefill-lens 4096,8192]
                    [--floor-model synthetic:smollm2-135m] [--attention-backend auto]
    CPU, small: pd-bench engine --device cpu --dtype float32 --model synthetic:tiny-llama
                    --floor-model synthetic:tiny-llama --batch-sizes 1,4 --contexts 64
                    --prefill-lens 128 --steps 4 --warmup-steps 1 --bandwidth-bytes 64MiB
                    --gemm-size 256
    speculative: pd-bench engine --num-speculative-tokens 4 (verify steps beside decode steps,
    verify_step.py)

Decode: `batch` requests admitted at `context` tokens through the decode role's path (reserve +
add_prefilled: KV blocks in place, no prefill run), then `--steps` calls of `EngineCore.step()`
after `--warmup-steps`, timed together on the host: the time per step (with async scheduling,
on CUDA by default, a call launches step n+1 and returns step n's tokens, so the host's work
hides under the device's; `--async-scheduling off` shows the synchronous step). Its ceiling is the roofline: the bytes a step must read (every weight once,
the LM head included, plus each request's KV context) over the copy bandwidth measured here.
Prefill: one prompt of N tokens in one step (its first token sampled), FLOPs over time, against
a bf16 (the model dtype's) square GEMM measured here. Floor: `--floor-model` at batch 1.

`--tensor-parallel-size N` (`--devices`): the engine over N ranks (gloo on CPU, NCCL on CUDA);
a second table gives, per decode case on rank 0, the time in collectives (the all-reduces and
the LM head's gather: their share of the step) and in the step broadcast (tp_costs.py). The
ceilings and the floor stay one device's.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks.engine import ceilings as ceil
from benchmarks.engine import tp_costs
from benchmarks.engine.verify_step import add_spec_flag, spec_kwargs, use_fixed_drafts
from benchmarks.serve.report import write_json
from engine.engine_core import EngineCore
from engine.model import resolve_device, resolve_dtype
from pdserve.cli import ArgumentParser, add_config_flags, config_from_args
from pdserve.config import (
    ASYNC_SCHEDULING,
    ATTENTION_BACKENDS,
    DTYPES,
    EngineConfig,
    ParallelConfig,
    parse_size,
)
from pdserve.engine_config import KV_CACHE_DTYPES
from pdserve.sampling_params import SamplingParams

MAX_STEPS_TO_FIRST_TOKEN = 64  # a whole prompt prefills in one step; async adds one more


@dataclass
class Row:
    case: str
    measured: str
    ceiling: str
    ratio: str
    value: float  # seconds (decode, floor) or FLOP/s (prefill)
    bound: float  # the ceiling in the same unit


def _flops(rate: float) -> str:
    return f"{rate / 1e12:.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"


def _ints(text: str) -> list[int]:
    try:
        return [int(parse_size(t)) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="pd-bench engine", description=__doc__.split("\n")[0])
    _add_engine_flags(p)
    add_config_flags(p, p.add_argument_group("tensor parallelism"), ParallelConfig, ())
    _add_workload_flags(p)
    _add_ceiling_flags(p)
    return p.parse_args(argv)


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Which model, and how the engine runs it."""
    p.add_argument(
        "--model", default="synthetic:llama3-8b", help="model to measure (default: %(default)s)"
    )
    p.add_argument(
        "--floor-model",
        default="synthetic:smollm2-135m",
        help="tiny model for the per-step floor at batch 1 ('' to skip)",
    )
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weights and KV dtype")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="KV storage")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="attention kernels (flash_attn: KV block size 256)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    p.add_argument(
        "--async-scheduling",
        default="auto",
        choices=ASYNC_SCHEDULING,
        help="launch step n+1 before waiting for step n (auto: on CUDA; default: %(default)s)",
    )


def _add_workload_flags(p: argparse.ArgumentParser) -> None:
    """The decode batches, contexts and prompts measured, and how many steps each."""
    p.add_argument(
        "--batch-sizes",
        type=_ints,
        default=[1, 8, 32, 128],
        help="decode batch sizes (default: 1,8,32,128)",
    )
    p.add_argument(
        "--contexts",
        type=_ints,
        default=[1024, 4096],
        help="decode context lengths in tokens, e.g. 1K,4K (default: 1024,4096)",
    )
    p.add_argument(
        "--prefill-lens",
        type=_ints,
        default=[4096, 8192],
        help="prompt lengths for the prefill rate ('' to skip; default: 4096,8192)",
    )
    p.add_argument("--floor-context", type=int, default=128, help="context of the floor run")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per case")
    p.add_argument("--warmup-steps", type=int, default=8, help="untimed decode steps first")
    p.add_argument("--prefill-iters", type=int, default=3, help="timed prefills per length")
    add_spec_flag(p)


def _add_ceiling_flags(p: argparse.ArgumentParser) -> None:
    """The ceilings measured in the same run, and the JSON file."""
    p.add_argument(
        "--bandwidth-bytes",
        type=parse_size,
        default=parse_size("2GiB"),
        help="buffer copied to measure memory bandwidth (default: 2GiB)",
    )
    p.add_argument("--gemm-size", type=int, default=8192, help="n of the n^3 GEMM ceiling")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")


def make_engine(
    args: argparse.Namespace, model: str, max_len: int, max_seqs: int, one_rank: bool = False
) -> EngineCore:
    """The engine measured (`one_rank`: at TP 1 whatever --tensor-parallel-size says)."""
    parallel = ParallelConfig() if one_rank else config_from_args(ParallelConfig, args)
    config = EngineConfig.from_kwargs(
        model=model, dtype=args.dtype, device=args.device, max_model_len=max_len,
        attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling, max_num_seqs=max_seqs, max_num_batched_tokens=max(max_len, 2048),
        enable_prefix_caching=False, kv_cache_dtype=args.kv_cache_dtype, **asdict(parallel),
        **spec_kwargs(args),
    )  # fmt: skip
    core = EngineCore(config)
    if core.spec is not None:
        use_fixed_drafts(core)
    return core


def decode_step_s(
    core: EngineCore, batch: int, context: int, steps: int, warmup: int, num_drafts: int = 0
) -> tuple[float, tp_costs.TPCosts | None]:
    """Host time per decode step of `batch` requests at `context` tokens: `steps` calls of
    `EngineCore.step()` after `warmup`, timed together (with async scheduling a call returns
    the previous step's tokens while launching the next, so single calls are not steps); with
    tensor parallelism, also what it costs the step (tp_costs.py). `num_drafts` > 0: verify
    steps of that many drafts per request (a speculating engine)."""
    ids = itertools.count()
    params = SamplingParams(
        temperature=0.0, max_tokens=2 * steps + warmup + 2 + num_drafts, ignore_eos=True,
        speculative=num_drafts > 0,
    )  # fmt: skip
    request_ids: list[str] = []
    for _ in range(batch):
        rid = f"decode-{next(ids)}"
        prompt = [(7 * i + len(request_ids)) % 500 + 10 for i in range(context)]
        request = core.make_request(rid, prompt, params)
        core.add_prefilled(request, core.reserve(rid, context + 1), first_token=11)
        request_ids.append(rid)
    for _ in range(warmup):
        core.step()
    costs = None
    if core.tp is not None:
        costs = tp_costs.measure(core, lambda n: _run_steps(core, n), steps)
        step_s = costs.step_s
    else:
        start = time.perf_counter()
        _run_steps(core, steps)
        step_s = (time.perf_counter() - start) / steps
    for rid in request_ids:
        core.abort(rid)
    while core.has_unfinished():
        core.step()
    return step_s, costs


def _run_steps(core: EngineCore, steps: int) -> None:
    for _ in range(steps):
        core.step()


def prefill_s(core: EngineCore, num_tokens: int, iters: int) -> float:
    """Median time of one step that prefills a whole prompt of `num_tokens`."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(iters + 1):
        prompt = [(13 * j + i) % 500 + 10 for j in range(num_tokens)]
        rid = f"prefill-{num_tokens}-{i}"
        core.add_request(core.make_request(rid, prompt, params))
        start = time.perf_counter()
        for _ in range(MAX_STEPS_TO_FIRST_TOKEN):  # until its token is out
            if any(out.request_id == rid for out in core.step()):
                break
        else:
            raise RuntimeError(
                f"no token for a {num_tokens}-token prompt in {MAX_STEPS_TO_FIRST_TOKEN} steps"
            )
        times.append(time.perf_counter() - start)
        while core.has_unfinished():
            core.step()
    return statistics.median(times[1:])  # the first one compiles kernels


def decode_rows(
    args, core: EngineCore, bandwidth: float, label: str, tp_info: list[dict] | None = None
) -> list[Row]:
    rows = []
    model, arch, dtype = core.loaded.model, core.arch, core.pool.dtype  # (KV: the pool's)
    for context, batch in itertools.product(args.contexts, args.batch_sizes):
        step, costs = decode_step_s(core, batch, context, args.steps, args.warmup_steps)
        if costs is not None and tp_info is not None:
            tp_info.append({"case": f"{label} decode batch {batch} ctx {context}", **asdict(costs),
                            "collective_share": costs.collective_share})  # fmt: skip
        num_bytes = ceil.decode_bytes(model, arch, dtype, batch, context)
        roofline = num_bytes / bandwidth
        rows.append(Row(
            f"{label} decode batch {batch} ctx {context}", f"{step * 1e3:.3f} ms/step",
            f"{roofline * 1e3:.3f} ms ({num_bytes / 1e9:.3g} GB)", f"{step / roofline:.2f}x",
            step, roofline,
        ))  # fmt: skip
        if (k := args.num_speculative_tokens) > 0 and core.spec is not None:
            verify, _ = decode_step_s(core, batch, context, args.steps, args.warmup_steps, k)
            rows.append(Row(
                f"{label} verify K={k} batch {batch} ctx {context}", f"{verify * 1e3:.3f} ms/step",
                f"decode {step * 1e3:.3f} ms/step", f"{verify / step:.2f}x", verify, step,
            ))  # fmt: skip
    return rows


def prefill_rows(args, core: EngineCore, gemm: float, label: str) -> list[Row]:
    rows = []
    for num_tokens in args.prefill_lens:
        elapsed = prefill_s(core, num_tokens, args.prefill_iters)
        rate = ceil.prefill_flops(core.loaded.model, core.arch, num_tokens) / elapsed
        rows.append(Row(
            f"{label} prefill {num_tokens} tokens", _flops(rate), f"GEMM {_flops(gemm)}", f"{rate / gemm:.0%}", rate, gemm,
        ))  # fmt: skip
    return rows


def run(args: argparse.Namespace) -> tuple[list[Row], dict]:
    lengths = [*args.contexts, args.floor_context]
    max_len = max(
        max(lengths) + 2 * args.steps + args.warmup_steps + 8, max(args.prefill_lens, default=0) + 8
    )
    device = resolve_device(args.device)
    # Ceilings first, while the memory is free (the engine's KV pool then takes most of it).
    bandwidth = ceil.memory_bandwidth(device, args.bandwidth_bytes)
    gemm = ceil.gemm_rate(device, resolve_dtype(args.dtype, device, args.model), args.gemm_size)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    core = make_engine(args, args.model, max_len, max(args.batch_sizes))
    graphs = core.runner.decode_graphs
    info = {
        "model": args.model, "dtype": str(core.dtype), "kv_dtype": str(core.pool.dtype),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "attention": core.attn_backend.name, "block_size": core.pool.block_size,
        "cuda_graphs": bool(graphs and graphs.captured),
        "graph_capture_s": graphs.capture_s if graphs else 0.0,
        "graph_pool_mib": graphs.pool_bytes / (1 << 20) if graphs else 0.0,
        "async_scheduling": core.async_scheduling,
        "layer_ops": core.loaded.model.layer_ops.name, "pdl": core.loaded.dependent_launch,
        "bandwidth_GBps": bandwidth / 1e9, "gemm_TFLOPs": gemm / 1e12,
    }  # fmt: skip
    label = args.model.removeprefix("synthetic:")
    info["tensor_parallel_size"] = args.tensor_parallel_size
    info["tp"] = []
    rows = decode_rows(args, core, bandwidth, label, info["tp"])
    rows += prefill_rows(args, core, gemm, label)
    core.close()
    del core, graphs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.floor_model:
        floor_len = args.floor_context + 2 * args.steps + args.warmup_steps + 8  # decode only
        floor = make_engine(args, args.floor_model, floor_len, 8, one_rank=True)
        floor_args = argparse.Namespace(**{**vars(args), "contexts": [args.floor_context],
                                           "batch_sizes": [1]})  # fmt: skip
        floor_label = args.floor_model.removeprefix("synthetic:") + " floor"
        rows += decode_rows(floor_args, floor, bandwidth, floor_label)
        floor.close()
    return rows, info


def format_table(rows: list[Row], info: dict) -> str:
    head = (
        f"pd-bench engine: {info['model']} {info['dtype']} on {info['device_name']}, attention "
        f"{info['attention']} (block {info['block_size']}), decode "
        f"{'CUDA graphs' if info['cuda_graphs'] else 'eager'}"
        + (f" (captured in {info['graph_capture_s']:.1f} s, {info['graph_pool_mib']:.0f} MiB)"
           if info["cuda_graphs"] else "")
        + f", async scheduling {'on' if info['async_scheduling'] else 'off'}"
        + f", layer ops {info['layer_ops']}, PDL {'on' if info['pdl'] else 'off'}"
        + f"\nceilings measured in this run: memory copy {info['bandwidth_GBps']:.0f} GB/s "
        f"(read+write), GEMM {_flops(info['gemm_TFLOPs'] * 1e12)} ({info['dtype']})\n"
    )  # fmt: skip
    lines = ["| case | measured | ceiling | ratio |", "|---|---|---|---|"]
    lines += [f"| {r.case} | {r.measured} | {r.ceiling} | {r.ratio} |" for r in rows]
    return head + "\n".join(lines) + tp_costs.format_table(info)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows, info = run(args)
    print(format_table(rows, info), flush=True)
    if args.json:
        write_json(args.json, {"info": info, "rows": [asdict(r) for r in rows]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
