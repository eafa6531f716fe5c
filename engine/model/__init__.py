"""Model sources (HF folder, GGUF, `synthetic:<shape>`, aliases) and the Llama-family model.

The names below load on first use (PEP 562): resolving a model (`engine.model.sources`,
`engine.model.prepare`) does not build the model's modules."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from engine.model.arch_config import ModelArchConfig
    from engine.model.loader import LoadedModel, load_model, resolve_device, resolve_dtype

__all__ = ["LoadedModel", "ModelArchConfig", "load_model", "resolve_device", "resolve_dtype"]

_WHERE = {
    "ModelArchConfig": "engine.model.arch_config",
    "LoadedModel": "engine.model.loader",
    "load_model": "engine.model.loader",
    "resolve_device": "engine.model.loader",
    "resolve_dtype": "engine.model.loader",
}

__getattr__ = lazy_exports(__name__, _WHERE)
