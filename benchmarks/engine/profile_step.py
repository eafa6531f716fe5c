"""pd-bench profile: where a decode step's time goes, host phase by phase and GPU kernel by
kernel.

    pd-bench profile [--model synthetic:llama3-8b] [--batch-sizes 1,32] [--context 1024]
                     [--dtype bfloat16] [--attention-backend auto] [--enforce-eager] [--sync]
    CPU, small: pd-bench profile --device cpu --dtype float32 --model synthetic:tiny-llama
                     --batch-sizes 1,2 --context 32 --steps 3 --warmup-steps 1

Each batch size: `batch` requests admitted at `context` tokens through the decode role's path
(reserve + add_prefilled), then `EngineCore.step()`'s phases run one by one, each timed with
perf_counter on the host:

    schedule   Scheduler.schedule()
    inputs     ModelRunner.prepare(): numpy step inputs, one copy
    forward    ModelRunner.forward(): CUDA graph replay or the eager forward (queued only)
    sample     ModelRunner.sample(): logits, sampler, the one copy of the ids (waits for the GPU)
    outputs    Scheduler.on_launched() + update_from_output(): stop checks, StepOutputs
    detok      IncrementalDetokenizer.update per request (models with a tokenizer only)

Without `--sync` the GPU's work lands in `sample` (its copy waits); with `--sync` a device
sync closes `inputs` and `forward`, so `forward` holds the GPU time and `sample` its own.
Then `--profile-steps` steps under torch.profiler: GPU kernel time by kernel name (top
`--top`), kernels per step (memcpy/memset included) and host calls that enqueue device work per
step (cudaLaunchKernel, cuLaunchKernel(Ex) for Triton, cudaGraphLaunch: one per replayed step,
cudaMemcpyAsync, cudaMemsetAsync). On CPU the table lists aten ops by self CPU time instead.
Last, `--steps` calls of `EngineCore.step()` timed together: "engine step ms", the step as the
engine runs it (with async scheduling, on CUDA by default, the phases above overlap the GPU's
work, so it is about the GPU's time rather than "step ms", their synchronous sum).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.engine.bench_engine import _ints
from benchmarks.serve.report import write_json
from engine.engine_core import EngineCore
from pdserve.config import ATTENTION_BACKENDS, DTYPES, EngineConfig
from pdserve.detokenizer import IncrementalDetokenizer
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer

PHASES = ("schedule", "inputs", "forward", "sample", "outputs", "detok")
# Host-side calls that launch device work (one cudaGraphLaunch runs a whole captured step).
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")  # fmt: skip


@dataclass
class KernelRow:
    name: str
    calls_per_step: float
    us_per_step: float  # device time (CUDA) or self CPU time (CPU ops)
    share: float


@dataclass
class BatchProfile:
    batch: int
    step_ms: float  # median wall time of the whole phased step
    engine_step_ms: float  # EngineCore.step() as the engine runs it (async scheduling included)
    phase_ms: dict[str, float]  # median per phase
    kernels_per_step: float
    launches_per_step: float
    device_ms_per_step: float
    top: list[KernelRow] = field(default_factory=list)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pd-bench profile", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="synthetic:llama3-8b", help="model (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weights and KV dtype")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="attention kernels (layer ops follow: Triton with triton/flash_attn)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    p.add_argument(
        "--batch-sizes", type=_ints, default=[1, 32], help="decode batch sizes (default: 1,32)"
    )
    p.add_argument("--context", type=int, default=1024, help="context tokens of each request")
    p.add_argument("--steps", type=int, default=20, help="timed phased steps per batch size")
    p.add_argument("--warmup-steps", type=int, default=5, help="untimed steps first")
    p.add_argument("--profile-steps", type=int, default=5, help="steps under torch.profiler")
    p.add_argument("--top", type=int, default=15, help="kernels listed per batch size")
    p.add_argument(
        "--sync",
        action="store_true",
        help="sync the device after inputs and forward (GPU time in 'forward')",
    )
    p.add_argument(
        "--trace", default=None, help="write a Chrome trace per batch size: PREFIX-bN.json"
    )
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    return p.parse_args(argv)  # fmt: skip


def make_engine(args: argparse.Namespace) -> EngineCore:
    max_len = args.context + _max_tokens(args) + 8
    config = EngineConfig.from_kwargs(
        model=args.model, dtype=args.dtype, device=args.device, max_model_len=max_len,
        attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
        max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=max(max_len, 2048),
        enable_prefix_caching=False,
    )  # fmt: skip
    return EngineCore(config)


class PhasedStepper:
    """`EngineCore.step()` for a decode batch, phase by phase, each timed on the host."""

    def __init__(self, core: EngineCore, sync: bool) -> None:
        self.core = core
        sync_device = sync and core.device.type == "cuda"
        self._sync: Callable[[], None] = torch.cuda.synchronize if sync_device else lambda: None
        tokenizer_dir = core.loaded.tokenizer_dir
        self.tokenizer = Tokenizer.from_dir(tokenizer_dir) if tokenizer_dir else None
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}

    def track(self, request_id: str, prompt: list[int]) -> None:
        if self.tokenizer is not None:
            self.detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, prompt)

    def step(self) -> dict[str, float]:
        core, runner, clock = self.core, self.core.runner, time.perf_counter
        t0 = clock()
        scheduler_output = core.scheduler.schedule()
        t1 = clock()
        batch = runner.prepare(scheduler_output)
        self._sync()
        t2 = clock()
        hidden = runner.forward(batch, core.on_layer_done)
        self._sync()
        t3 = clock()
        sampled = runner.sample(batch, hidden)
        t4 = clock()
        core.scheduler.on_launched(scheduler_output)
        outputs = core.scheduler.update_from_output(scheduler_output, sampled.sampled)
        t5 = clock()
        for out in outputs:
            detokenizer = self.detokenizers.get(out.request_id)
            if detokenizer is not None:
                detokenizer.update(out.new_token_ids)
        t6 = clock()
        return dict(zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)))


def admit(core: EngineCore, stepper: PhasedStepper, batch: int, context: int, max_tokens: int):
    ids = itertools.count()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request_ids = []
    for r in range(batch):
        rid = f"profile-{batch}-{next(ids)}"
        prompt = [(7 * i + r) % 500 + 10 for i in range(context)]
        request = core.make_request(rid, prompt, params)
        core.add_prefilled(request, core.reserve(rid, context + 1), first_token=11)
        stepper.track(rid, prompt)
        request_ids.append(rid)
    return request_ids


def _device_time(event) -> float:
    value = getattr(event, "self_device_time_total", None)
    return float(value if value is not None else event.self_cuda_time_total)


def kernel_table(
    prof, steps: int, on_cuda: bool, top: int
) -> tuple[list[KernelRow], float, float, float]:
    """(top rows, kernels per step, launch calls per step, device ms per step)."""
    averages = prof.key_averages()
    if on_cuda:
        device = [e for e in averages if e.device_type.name == "CUDA"]
        times = {e.key: (_device_time(e), e.count) for e in device}
    else:
        device = [e for e in averages if e.key.startswith("aten::")]
        times = {e.key: (float(e.self_cpu_time_total), e.count) for e in device}
    total_us = sum(t for t, _ in times.values()) or 1.0
    rows = [
        KernelRow(name, count / steps, us / steps, us / total_us)
        for name, (us, count) in sorted(times.items(), key=lambda kv: -kv[1][0])[:top]
    ]
    kernels = sum(count for _, count in times.values()) / steps
    launches = sum(e.count for e in averages if e.key in LAUNCH_CALLS) / steps
    return rows, kernels, launches, total_us / steps / 1e3


def _max_tokens(args: argparse.Namespace) -> int:
    """Tokens each request may decode: every step the profile runs (the synchronous phases,
    the profiled steps, the engine's own steps: `args.steps` more), and two to spare."""
    return args.warmup_steps + 2 * args.steps + args.profile_steps + 2


def profile_batch(core: EngineCore, args: argparse.Namespace, batch: int) -> BatchProfile:
    stepper = PhasedStepper(core, args.sync)
    request_ids = admit(core, stepper, batch, args.context, _max_tokens(args))
    on_cuda = core.device.type == "cuda"
    for _ in range(args.warmup_steps):
        stepper.step()
    phases = [stepper.step() for _ in range(args.steps)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    if on_cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            stepper.step()
        if on_cuda:
            torch.cuda.synchronize()
    if args.trace:
        prof.export_chrome_trace(f"{args.trace}-b{batch}.json")
    start = time.perf_counter()  # the engine's own steps, last: they may leave one in flight
    for _ in range(args.steps):
        core.step()
    engine_step_ms = (time.perf_counter() - start) / args.steps * 1e3
    for rid in request_ids:
        core.abort(rid)
    while core.has_unfinished():
        core.step()
    top, kernels, launches, device_ms = kernel_table(prof, args.profile_steps, on_cuda, args.top)
    return BatchProfile(
        batch=batch,
        step_ms=statistics.median(sum(p.values()) for p in phases) * 1e3,
        engine_step_ms=engine_step_ms,
        phase_ms={name: statistics.median(p[name] for p in phases) * 1e3 for name in PHASES},
        kernels_per_step=kernels, launches_per_step=launches, device_ms_per_step=device_ms,
        top=top,
    )  # fmt: skip


def format_report(results: list[BatchProfile], info: dict) -> str:
    unit = "GPU" if info["device"].startswith("cuda") else "CPU (aten ops, self time)"
    lines = [
        f"pd-bench profile: {info['model']} {info['dtype']} on {info['device_name']}, attention "
        f"{info['attention']}, layer ops {info['layer_ops']}, decode {info['decode']}, context "
        f"{info['context']}{', synced phases' if info['sync'] else ''}"
        + (
            "\nPDL on (kernels/pdl.py): a kernel counts from its launch, before the one ahead of"
            " it ends, so kernel times overlap and do not add up; PDSERVE_PDL=0 for a breakdown"
            if info["pdl"]
            else ""
        ),
        "",
        "| batch | step ms | engine step ms | "
        + " | ".join(PHASES)
        + " | "
        + (
            "kernels/step | launches/step | GPU ms/step |"
            if unit == "GPU"
            else "aten ops/step | launches/step | op self ms/step |"
        ),
        "|---" * (len(PHASES) + 6) + "|",
    ]
    for r in results:
        phases = " | ".join(f"{r.phase_ms[p]:.3f}" for p in PHASES)
        lines.append(f"| {r.batch} | {r.step_ms:.3f} | {r.engine_step_ms:.3f} | {phases} | "
                     f"{r.kernels_per_step:.0f} | "
                     f"{r.launches_per_step:.0f} | {r.device_ms_per_step:.3f} |")  # fmt: skip
    for r in results:
        lines += ["", f"batch {r.batch}: top {len(r.top)} by {unit} time per step",
                  "| kernel | calls/step | us/step | share |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {k.name[:90]} | {k.calls_per_step:.1f} | {k.us_per_step:.1f} | "
                  f"{k.share:.1%} |" for k in r.top]  # fmt: skip
    return "\n".join(lines)


def run(args: argparse.Namespace) -> tuple[list[BatchProfile], dict]:
    core = make_engine(args)
    graphs = core.runner.decode_graphs
    info = {
        "model": args.model, "dtype": str(core.dtype), "device": str(core.device),
        "device_name": torch.cuda.get_device_name(core.device) if core.device.type == "cuda"
        else "cpu",
        "attention": core.attn_backend.name, "layer_ops": core.loaded.model.layer_ops.name,
        "decode": "CUDA graphs" if graphs is not None and graphs.captured else "eager",
        "context": args.context, "sync": args.sync, "pdl": core.loaded.dependent_launch,
    }  # fmt: skip
    results = [profile_batch(core, args, batch) for batch in args.batch_sizes]
    core.check_no_leaks()
    return results, info


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results, info = run(args)
    print(format_report(results, info), flush=True)
    if args.json:
        write_json(args.json, {"info": info, "batches": [asdict(r) for r in results]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
