"""Tiny random Hugging Face checkpoints of each supported variant, and paged-batch builders."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine.model.arch_config import ModelArchConfig
from kernels.attention.metadata import AttentionMetadata

_COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.15,  # large enough that logits spread (std ~1), so diffs show
    bos_token_id=1,
    eos_token_id=2,
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # < max_position_embeddings: all bands in play
}

# variant -> (model_type, config overrides, rewrite config.json in the pre-5.0 rope form)
HF_VARIANTS: dict[str, tuple[str, dict, bool]] = {
    "llama": ("llama", dict(tie_word_embeddings=False), False),
    "llama-attention-bias": ("llama", dict(attention_bias=True), False),  # q/k/v and o_proj
    "llama-linear-rope": (
        "llama",
        dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
        False,
    ),
    "llama3-rope-tied": (
        "llama",
        dict(rope_parameters=_LLAMA3_ROPE, tie_word_embeddings=True),
        False,
    ),
    "llama3-rope-legacy-config": ("llama", dict(rope_parameters=_LLAMA3_ROPE), True),
    "mistral": ("mistral", dict(sliding_window=None), False),
    "qwen2-bias-tied": ("qwen2", dict(tie_word_embeddings=True), False),
    "qwen3-qk-norm": ("qwen3", dict(head_dim=32), False),  # head_dim != hidden / heads
}


@dataclass
class HFCheckpoint:
    path: Path
    model: torch.nn.Module  # the transformers model the folder was saved from (fp32, eval)


def build_hf_checkpoint(variant: str, path: Path, seed: int = 0) -> HFCheckpoint:
    """Save a seeded random transformers model of `variant` (safetensors) to `path`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides, legacy_rope = HF_VARIANTS[variant]
    config = AutoConfig.for_model(model_type, **_COMMON, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0; make both matter
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    if legacy_rope:
        _rewrite_rope_legacy(path / "config.json")
    return HFCheckpoint(path, model)


def _rewrite_rope_legacy(config_path: Path) -> None:
    """transformers < 5 form: top-level rope_theta, rope_scaling with the old "type" key."""
    config = json.loads(config_path.read_text())
    params = dict(config.pop("rope_parameters"))
    config["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    config["rope_scaling"] = params
    config_path.write_text(json.dumps(config))


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, HFCheckpoint]:
    root = tmp_path_factory.mktemp("hf-tiny")
    return {variant: build_hf_checkpoint(variant, root / variant) for variant in HF_VARIANTS}


# ---- paged batches --------------------------------------------------------------------------


def make_kv_caches(
    arch: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fresh zeroed paged cache: per layer k, v [num_blocks, block_size, kv_heads, head_dim]."""
    shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
        for _ in range(arch.num_layers)
    ]


def assign_blocks(
    total_lens: list[int], block_size: int, seed: int = 0
) -> tuple[list[list[int]], int]:
    """Shuffled, non-contiguous block ids for requests that will hold `total_lens` tokens.

    Returns (block ids per request, pool size); the pool has two spare blocks.
    """
    counts = [math.ceil(n / block_size) for n in total_lens]
    num_blocks = sum(counts) + 2
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    block_ids, start = [], 0
    for count in counts:
        block_ids.append(perm[start : start + count])
        start += count
    return block_ids, num_blocks


@dataclass
class Step:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata


def build_step(
    chunks: list[tuple[list[int], int]], block_ids: list[list[int]], block_size: int
) -> Step:
    """One flat varlen step: chunks[i] = (token ids new this step, tokens of request i already
    in the cache); request i's cache lives in block_ids[i]. Decodes must come first."""
    query_lens = [len(tokens) for tokens, _ in chunks]
    num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    assert all(n != 1 for n in query_lens[num_decodes:]), "order decodes (1 token) first"
    seq_lens = [len(tokens) + num_cached for tokens, num_cached in chunks]
    positions = [pos for (tokens, cached) in chunks for pos in range(cached, cached + len(tokens))]
    req_of_token = [i for i, n in enumerate(query_lens) for _ in range(n)]
    slots = [
        block_ids[i][pos // block_size] * block_size + pos % block_size
        for i, pos in zip(req_of_token, positions)
    ]
    block_tables = torch.zeros(len(chunks), max(len(ids) for ids in block_ids), dtype=torch.int32)
    for i, ids in enumerate(block_ids):
        block_tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(
            [0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_decodes=num_decodes,
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
    )
    input_ids = torch.tensor([t for tokens, _ in chunks for t in tokens], dtype=torch.int64)
    return Step(input_ids, torch.tensor(positions, dtype=torch.int64), meta)


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]
