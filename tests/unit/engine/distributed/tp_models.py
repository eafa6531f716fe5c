"""Models and fakes the tensor-parallel tests share."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from engine.distributed import ModelPartition, partition_model
from engine.model import load_model
from engine.model.llama import LlamaForCausalLM
from kernels.attention import get_attention_backend
from pdserve.config import ModelConfig


def build_biased_llama(path: Path) -> Path:
    """A tiny Hugging Face Llama with attention_bias (so o_proj has a bias: row-parallel, it
    is added on rank 0 only)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", vocab_size=509, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        attention_bias=True, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # transformers zeroes biases at init: give them values
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.uniform_(-0.1, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_rank(model: str, rank: int, world_size: int) -> tuple[LlamaForCausalLM, ModelPartition]:
    """Rank `rank`'s shard of `model`, loaded in this process (no process group: a stand-in
    for the TensorParallel the loader reads `partition` and `layers` from)."""
    whole = load_model(ModelConfig(model=model), _backend(), torch.device("cpu"), torch.float32)
    part = partition_model(whole.arch, rank, world_size)
    tp = SimpleNamespace(partition=part, layers=object())
    loaded = load_model(
        ModelConfig(model=model), _backend(), torch.device("cpu"), torch.float32, tp
    )
    return loaded.model, part


def load_whole(model: str) -> LlamaForCausalLM:
    return load_model(
        ModelConfig(model=model), _backend(), torch.device("cpu"), torch.float32
    ).model


def _backend():  # noqa: ANN202
    return get_attention_backend("torch", torch.device("cpu"), torch.float32, 16)


def failing_init(core: object) -> None:
    """A worker_init that fails (run in a worker rank's process)."""
    raise RuntimeError("worker_init failed on purpose")


def hanging_init(core: object) -> None:
    """A worker_init that never returns (run in a worker rank's process)."""
    import time

    time.sleep(3600)


def chunk_keys(chunks: object) -> list[list[object]]:
    """What a layer hook call says about each prefill chunk: request, start, tokens, blocks."""
    return [[c.request_id, c.start_pos, c.num_tokens, list(c.block_ids)] for c in chunks]  # type: ignore[attr-defined]


def recording_init(path: str, core: object) -> dict[str, int]:
    """A worker_init (functools.partial(recording_init, path)): the rank's layer hook appends
    each call, with the rank's shard and KV pool, to `path` (one JSON line per call); returns
    the rank and its pid (what rank 0 gets back)."""
    import json
    import os

    tp, pool = core.tp, core.pool  # type: ignore[attr-defined]
    shard = [tp.rank, tp.shard.kv_head_start, tp.shard.kv_head_end, tp.shard.replicated]
    pool_heads = pool.kv_caches[0][0].shape[2]

    def hook(layer_idx: int, chunks: object) -> None:
        assert core.layer_ready(layer_idx) is None  # type: ignore[attr-defined]  # CPU
        line = {"shard": shard, "pool_heads": pool_heads, "num_blocks": pool.num_blocks,
                "layer": layer_idx, "chunks": chunk_keys(chunks)}  # fmt: skip
        with open(path, "a") as out:
            out.write(json.dumps(line) + "\n")

    core.on_layer_done = hook  # type: ignore[attr-defined]
    return {"rank": tp.rank, "pid": os.getpid()}
