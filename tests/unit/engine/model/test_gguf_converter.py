"""GGUF -> cached HF folder: names, llama.cpp's Q/K permutation, dequantization, caching.

Tiny GGUF files are written here from tiny transformers models the way llama.cpp's
convert_hf_to_gguf.py writes them, so the converted model must reproduce transformers' logits.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import stat
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.model import gguf_converter, load_model
from engine.model.gguf_converter import convert_gguf
from engine.model.sources import ALIASES
from kernels.attention.torch_backend import TorchAttentionBackend
from pdserve.config import ModelConfig
from tests.unit.engine.model.conftest import (
    HFCheckpoint,
    assign_blocks,
    build_step,
    make_kv_caches,
    random_prompts,
)

# Hugging Face name pieces -> llama.cpp tensor names (written out independently of the converter)
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip


def gguf_name(hf_name: str) -> str:
    module, _, kind = hf_name.rpartition(".")
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)  # "model", "layers", N, "self_attn.q_proj"
    return f"blk.{layer}.{_LAYER[rest]}.{kind}"


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: interleave each head's rotary halves."""
    shape = weights.shape
    return (
        weights.reshape(num_heads, 2, shape[0] // num_heads // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def write_gguf(
    checkpoint: HFCheckpoint, arch: str, path: Path, quantize: bool = False
) -> dict[str, torch.Tensor]:
    """Write `checkpoint` as a llama.cpp GGUF; returns the HF weights it encodes (after Q8_0
    rounding when `quantize`)."""
    config = checkpoint.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    encoded = {}
    for name, tensor in checkpoint.model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        weights = tensor.numpy()
        if quantize and weights.ndim == 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            weights = gguf.quants.dequantize(gguf.quants.quantize(weights, qtype), qtype)
        encoded[name] = torch.from_numpy(weights.copy())
        if arch == "llama" and ".q_proj." in name:
            weights = llama_cpp_permute(weights, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            weights = llama_cpp_permute(weights, config.num_key_value_heads)
        if quantize and weights.ndim == 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(
                gguf_name(name), gguf.quants.quantize(weights, qtype), raw_dtype=qtype
            )
        else:
            writer.add_tensor(gguf_name(name), np.ascontiguousarray(weights))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return encoded


def prefill_logits(model_path: str | Path, prompts: list[list[int]]) -> torch.Tensor:
    loaded = load_model(
        ModelConfig(model=str(model_path)),
        TorchAttentionBackend(),
        torch.device("cpu"),
        torch.float32,
    )
    lens = [len(p) for p in prompts]
    block_ids, num_blocks = assign_blocks(lens, 4)
    kv_caches = make_kv_caches(loaded.arch, num_blocks, 4)
    step = build_step([(p, 0) for p in prompts], block_ids, 4)
    with torch.inference_mode():
        return loaded.model.compute_logits(
            loaded.model(step.input_ids, step.positions, kv_caches, step.meta)
        )


def reference_logits(model: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([model(torch.tensor([p])).logits[0] for p in prompts])


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize(
    "variant, arch, quantize",
    [
        ("llama", "llama", False),
        ("llama", "llama", True),
        ("qwen2-bias-tied", "qwen2", False),
        ("qwen3-qk-norm", "qwen3", False),
    ],
)
def test_converted_gguf_matches_transformers(
    variant, arch, quantize, hf_checkpoints, cache_dir, tmp_path
):
    checkpoint = hf_checkpoints[variant]
    path = tmp_path / f"{variant}.gguf"
    encoded = write_gguf(checkpoint, arch, path, quantize)
    reference = copy.deepcopy(checkpoint.model)
    reference.load_state_dict(encoded, strict=False)  # Q8_0-rounded weights when quantized
    prompts = random_prompts([6, 19, 11], 384, seed=6)

    ours = prefill_logits(path, prompts)

    torch.testing.assert_close(ours, reference_logits(reference, prompts), atol=1e-4, rtol=1e-4)
    (folder,) = (cache_dir / "models").iterdir()
    assert folder.name.startswith(f"{variant}-")
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] == checkpoint.model.config.tie_word_embeddings
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [2]
    assert not (folder / "tokenizer.json").exists()  # these files carry no tokenizer


def test_conversion_is_cached_and_keyed_by_the_files_content(
    hf_checkpoints, cache_dir, tmp_path, monkeypatch
):
    path = tmp_path / "tiny.gguf"
    write_gguf(hf_checkpoints["llama"], "llama", path)
    first = convert_gguf(path)
    assert stat.S_IMODE(first.stat().st_mode) == 0o755  # a shared cache stays readable
    assert stat.S_IMODE((first / "model.safetensors").stat().st_mode) == 0o644

    def must_not_run(*args):
        raise AssertionError("a cached conversion was redone")

    monkeypatch.setattr(gguf_converter, "write_hf_folder", must_not_run)
    assert convert_gguf(path) == first

    file_stat = path.stat()
    os.utime(path, ns=(file_stat.st_atime_ns, file_stat.st_mtime_ns + 1_000_000))
    assert convert_gguf(path) == first  # touched, the same content: the same folder
    write_gguf(hf_checkpoints["qwen2-bias-tied"], "qwen2", path)
    with pytest.raises(AssertionError, match="redone"):
        convert_gguf(path)  # another content is converted again


def test_failed_conversion_leaves_nothing_behind(hf_checkpoints, cache_dir, tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_gguf(hf_checkpoints["llama"], "llama", path)

    def crash_midway(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("killed")

    monkeypatch.setattr(gguf_converter, "write_hf_folder", crash_midway)
    with pytest.raises(RuntimeError, match="killed"):
        convert_gguf(path)
    assert list((cache_dir / "models").iterdir()) == []


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    head_dim, theta = 16, 500000.0
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    factors = np.where(
        wavelen < 8192 / 4.0, 1.0, np.where(wavelen > 8192, 8.0, 1 / ((1 - smooth) / 8.0 + smooth))
    )
    scaling = gguf_converter._llama3_scaling(factors.astype(np.float32), head_dim, theta)
    assert scaling == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }  # fmt: skip
    with pytest.raises(ValueError, match="do not match Llama 3.1 scaling"):
        gguf_converter._llama3_scaling(
            np.linspace(1, 8, head_dim // 2, dtype=np.float32), head_dim, theta
        )


def test_unsupported_gguf_architecture(tmp_path, cache_dir):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ValueError, match="architecture 'gpt2' is not supported; supported: llama, qwen2, qwen3"
    ):
        convert_gguf(path)


@pytest.fixture(scope="session")
def smollm2_folder() -> tuple[Path, float]:
    """The default model converted (or found in pdserve's cache); with the seconds it took."""
    start_s = time.perf_counter()
    folder = convert_gguf(ALIASES["smollm2-135m"]())
    return folder, time.perf_counter() - start_s


@pytest.mark.slow
def test_real_smollm2_gguf_matches_transformers(smollm2_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, convert_s = smollm2_folder
    gguf_path = ALIASES["smollm2-135m"]()
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in folder.iterdir()
    }
    assert (
        "<|im_start|>"
        in json.loads((folder / "tokenizer_config.json").read_text())["chat_template"]
    )

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [
        tokenizer.encode(text) for text in ("The capital of France is", "def fib(n):\n    return")
    ]
    start_s = time.perf_counter()
    ours = prefill_logits("smollm2-135m", prompts)
    load_s = time.perf_counter() - start_s
    print(
        f"\nSmolLM2 GGUF: convert/cache lookup {convert_s:.1f} s, cached load + forward {load_s:.1f} s"
    )

    reference = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, local_files_only=True
    ).eval()
    want = reference_logits(reference, prompts)
    torch.testing.assert_close(ours, want, atol=2e-3, rtol=1e-3)
    assert torch.equal(ours.argmax(-1), want.argmax(-1))


def test_conversion_and_loading_report_progress_off_a_terminal(
    hf_checkpoints, cache_dir, tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal: log lines, no bar
    caplog.set_level(logging.INFO)
    path = tmp_path / "tiny.gguf"
    write_gguf(hf_checkpoints["llama"], "llama", path)
    load_model(ModelConfig(model=str(path)), TorchAttentionBackend(), torch.device("cpu"),
               torch.float32)  # fmt: skip
    lines = [r.getMessage() for r in caplog.records]
    num_tensors = 3 + 9 * hf_checkpoints["llama"].model.config.num_hidden_layers
    converting = [line for line in lines if line.startswith("converting tiny.gguf: ")]
    assert f"converting tiny.gguf: 100% ({num_tensors}/{num_tensors} tensors" in "\n".join(
        converting
    )
    assert len([line for line in converting if "%" in line]) >= 5  # every tenth or so
    assert any("writing model.safetensors" in line for line in converting)
    loading = [line for line in lines if line.startswith("loading tiny weights: ")]
    assert loading and loading[-1].startswith(
        f"loading tiny weights: 100% ({num_tensors}/{num_tensors} tensors"
    )
    # no progress bar on a stream that is not a terminal (other output may land there: another
    # test's logging handler left on a closed stream reports its error to sys.stderr)
    written = sys.stderr.getvalue()
    assert "%|" not in written and "\r" not in written, written
