"""Temporary GPU check (deleted after the run)."""

import dataclasses
import tempfile
import time
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.model import load_model
from kernels.attention.torch_backend import TorchAttentionBackend
from tests.unit.engine.model.conftest import (
    assign_blocks,
    build_hf_checkpoint,
    build_step,
    make_kv_caches,
    random_prompts,
)

dev = torch.device("cuda")


def to_dev(step):
    meta = step.meta
    meta = dataclasses.replace(
        meta,
        **{
            f.name: getattr(meta, f.name).to(dev)
            for f in dataclasses.fields(meta)
            if isinstance(getattr(meta, f.name), torch.Tensor)
        },
    )
    return step.input_ids.to(dev), step.positions.to(dev), meta


def run(loaded, prompts, block_size, dtype):
    lens = [len(p) for p in prompts]
    ids, nb = assign_blocks(lens, block_size)
    kv = [(k.to(dev), v.to(dev)) for k, v in make_kv_caches(loaded.arch, nb, block_size, dtype)]
    x, pos, meta = to_dev(build_step([(p, 0) for p in prompts], ids, block_size))
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(x, pos, kv, meta))


root = Path(tempfile.mkdtemp())
for variant in ["llama3-rope-tied", "qwen2-bias-tied", "qwen3-qk-norm", "mistral"]:
    ck = build_hf_checkpoint(variant, root / variant)
    prompts = random_prompts([5, 17, 30], 384, seed=1)
    with torch.inference_mode():
        want = torch.cat([ck.model(torch.tensor([p])).logits[0] for p in prompts])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        loaded = load_model(ModelConfig(model=str(ck.path)), TorchAttentionBackend(), dev, dtype)
        got = run(loaded, prompts, 4, dtype).cpu()
        err = (got - want).abs().max().item()
        agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        print(f"{variant:18s} {str(dtype):15s} max_err={err:.2e} argmax_agree={agree:.3f}")

for model in ["synthetic:llama3-8b", "synthetic:qwen3-8b", "synthetic:qwen2.5-7b"]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    loaded = load_model(
        ModelConfig(model=model, seed=3), TorchAttentionBackend(), dev, torch.bfloat16
    )
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t
    mem = torch.cuda.max_memory_allocated() / 2**30
    prompts = random_prompts([512, 300, 100, 1000], loaded.arch.vocab_size, seed=2)
    logits = run(loaded, prompts, 16, torch.bfloat16)
    torch.cuda.synchronize()
    t = time.perf_counter()
    logits = run(loaded, prompts, 16, torch.bfloat16)
    torch.cuda.synchronize()
    fwd_s = time.perf_counter() - t
    again = load_model(
        ModelConfig(model=model, seed=3), TorchAttentionBackend(), dev, torch.bfloat16
    )
    same = all(
        torch.equal(a, b) for a, b in zip(loaded.model.parameters(), again.model.parameters())
    )
    print(
        f"{model}: load {load_s:.1f}s peak {mem:.1f} GiB, prefill 1912 tok {fwd_s * 1e3:.0f} ms, "
        f"finite={bool(torch.isfinite(logits).all())} std={logits.std().item():.2f} same_seed_same_weights={same}"
    )
    del loaded, again, logits
    torch.cuda.empty_cache()
