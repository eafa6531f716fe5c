"""Convert a llama.cpp GGUF file, once, into a cached Hugging Face folder.

```
<cache_dir>/models/<stem>-<hash of the file's sha256, converter version>/   (convert_cache.py)
    config.json              from GGUF metadata (legacy rope_theta/rope_scaling form)
    generation_config.json   bos / eos (+ end-of-turn) ids
    model.safetensors        dequantized to float32, HF names, Q/K rows un-permuted
    tokenizer.json, tokenizer_config.json (with chat_template)   via transformers' GGUF reader
```

The key is the file's content, so copies of one file (each clone installs its own) share one
folder. One process converts, under a file lock; others starting at the same time (a prefill
and a decode node) wait for it, then read its folder. The folder is written under a temporary
name and renamed into place, so a crash never leaves a half-written cache. Every later load only
reads the folder.

All dequantized tensors are held in memory while writing (fine for small models; an 8B model
needs ~32 GB of RAM and disk at float32).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from engine.model.arch_config import RopeConfig
from engine.model.convert_cache import conversion_lock, converted_folder
from engine.model.rope import rope_inv_freq
from pdserve.progress import still_working, track

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 1  # bump when the folder layout changes: old caches are then ignored

# general.architecture -> (HF architecture, HF model_type)
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),  # also Mistral and SmolLM2
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's form of Llama 3.1 RoPE scaling
_MISSING = object()


def convert_gguf(gguf_path: Path) -> Path:
    """The cached HF folder of `gguf_path`'s content, converting the file first if needed
    (under a lock: of processes starting together, one converts and the others wait)."""
    gguf_path = gguf_path.resolve()
    dst = converted_folder(gguf_path, CONVERTER_VERSION)
    if dst.is_dir():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    with conversion_lock(dst):
        if dst.is_dir():  # converted by the process that held the lock
            return dst
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
        try:
            start_s = time.perf_counter()
            write_hf_folder(gguf_path, tmp)
            _make_readable(tmp)
            tmp.rename(dst)
            logger.info(
                "converted %s to %s in %.1f s", gguf_path, dst, time.perf_counter() - start_s
            )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


def _make_readable(folder: Path) -> None:
    """mkdtemp and safetensors create owner-only files; a shared cache must be readable."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def write_hf_folder(gguf_path: Path, out_dir: Path) -> None:
    """Write config, generation config, weights and (if the file has one) tokenizer."""
    reader = GGUFReader(gguf_path)
    config = _hf_config(reader, gguf_path)
    num_tensors = sum(1 for t in reader.tensors if t.name != _ROPE_FREQS)
    what = f"converting {gguf_path.name}"
    logger.info("%s (once; later starts read the converted folder)", what)
    tensors = dict(track(_hf_tensors(reader, config), what, num_tensors, "tensors", logger))
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    logger.info("%s: writing model.safetensors (%.0f MB)", what, num_bytes / 1e6)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": _eos_ids(reader)}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _write_tokenizer(reader, gguf_path, out_dir)


def _field(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF file lacks the metadata key {key!r}")
        return default
    return field.contents()


def _hf_config(reader: GGUFReader, gguf_path: Path) -> dict[str, Any]:
    gguf_arch = _field(reader, "general.architecture")
    if gguf_arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{gguf_path.name}: GGUF architecture {gguf_arch!r} is not supported; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )

    def arch_field(key: str, default: Any = _MISSING) -> Any:
        return _field(reader, f"{gguf_arch}.{key}", default)

    tensor_shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    hidden_size = arch_field("embedding_length")
    num_heads = arch_field("attention.head_count")
    head_dim = arch_field("attention.key_length", hidden_size // num_heads)
    if arch_field("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{gguf_path.name}: partial rotary embeddings are not supported")
    rope_theta = float(arch_field("rope.freq_base", 10000.0))
    hf_arch, model_type = GGUF_ARCHITECTURES[gguf_arch]
    return {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": tensor_shapes["token_embd.weight"][1],  # GGUF shapes are [cols, rows]
        "hidden_size": hidden_size,
        "intermediate_size": arch_field("feed_forward_length"),
        "num_hidden_layers": arch_field("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": arch_field("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        "max_position_embeddings": arch_field("context_length"),
        "rms_norm_eps": arch_field("attention.layer_norm_rms_epsilon"),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(reader, arch_field, head_dim, rope_theta),
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensor_shapes,
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
        "torch_dtype": "float32",
    }


def _rope_scaling(
    reader: GGUFReader, arch_field: Callable[..., Any], head_dim: int, rope_theta: float
) -> dict | None:
    scaling_type = arch_field("rope.scaling.type", "none")
    has_freqs = any(t.name == _ROPE_FREQS for t in reader.tensors)
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(arch_field("rope.scaling.factor"))}
    if scaling_type == "none" and not has_freqs:
        return None
    if scaling_type == "none":
        tensor = next(t for t in reader.tensors if t.name == _ROPE_FREQS)
        return _llama3_scaling(dequantize(tensor.data, tensor.tensor_type), head_dim, rope_theta)
    raise ValueError(
        f"GGUF rope scaling {scaling_type!r} is not supported; supported: none, linear, "
        "and Llama 3.1 scaling (rope_freqs)"
    )


def _llama3_scaling(freq_factors: np.ndarray, head_dim: int, rope_theta: float) -> dict:
    """Recover Llama 3.1 rope_scaling from llama.cpp's per-frequency divisors.

    llama.cpp stores only default_inv_freq / llama3_inv_freq; every Llama 3.x release uses
    low/high frequency factors 1 and 4 over an 8192-token original context, and the largest
    divisor is the factor. The result is checked against the stored divisors.
    """
    factor = float(freq_factors.max())
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    rope = RopeConfig(
        theta=rope_theta,
        scaling_type="llama3",
        factor=factor,
        original_max_position_embeddings=8192,
    )
    expected = rope_inv_freq(head_dim, RopeConfig(theta=rope_theta)) / rope_inv_freq(head_dim, rope)
    if not np.allclose(expected.numpy(), freq_factors, rtol=1e-3):
        raise ValueError(
            "GGUF rope_freqs do not match Llama 3.1 scaling (low/high frequency factors 1/4, "
            "original context 8192); other frequency tables are not supported"
        )
    return scaling


def _hf_tensors(reader: GGUFReader, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every weight; llama's Q/K rows back in HF order."""
    unpermute = config["model_type"] == "llama"
    num_heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        weights = dequantize(tensor.data, tensor.tensor_type)  # [rows, cols] (HF order)
        kind = tensor.name.split(".")[-2]
        if unpermute and kind in num_heads:
            weights = _unpermute_rows(weights, num_heads[kind])
        yield _hf_tensor_name(tensor.name), torch.from_numpy(np.array(weights, dtype=np.float32))


def _hf_tensor_name(gguf_name: str) -> str:
    base, _, param_kind = gguf_name.rpartition(".")  # "blk.3.attn_q", "weight"
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{param_kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{param_kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama-family counterpart")


def _unpermute_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation, which interleaves each head's two rotary halves."""
    half_head_dim = weights.shape[0] // num_heads // 2
    rows = weights.reshape(num_heads, half_head_dim, 2, *weights.shape[1:])
    return rows.swapaxes(1, 2).reshape(weights.shape)


def _eos_ids(reader: GGUFReader) -> list[int]:
    """EOS plus end-of-turn / end-of-message ids (instruct GGUFs stop on those too)."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [_field(reader, f"tokenizer.ggml.{key}", None) for key in keys]
    return list(dict.fromkeys(i for i in ids if i is not None))


def _write_tokenizer(reader: GGUFReader, gguf_path: Path, out_dir: Path) -> None:
    """tokenizer.json + tokenizer_config.json (chat_template included) via transformers."""
    if "tokenizer.ggml.model" not in reader.fields:
        logger.warning("%s carries no tokenizer; the model will take token ids only", gguf_path)
        return
    what = f"converting {gguf_path.name}: writing the tokenizer"
    logger.info("%s", what)
    with still_working(what, logger):  # transformers' GGUF reader: tens of seconds, silent
        from transformers import AutoTokenizer  # slow import, only needed when converting

        tokenizer = AutoTokenizer.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
        )
        tokenizer.save_pretrained(out_dir)
    chat_template = _field(reader, "tokenizer.chat_template", None)
    if chat_template:
        config_path = out_dir / "tokenizer_config.json"
        tokenizer_config = json.loads(config_path.read_text())
        tokenizer_config["chat_template"] = chat_template
        config_path.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))
