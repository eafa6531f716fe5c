"""Model sources (HF folder, GGUF, `synthetic:<shape>`, aliases) and the Llama-family model.

The names below load on first use (PEP 562): resolving a model (`engine.model.sources`,
`engine.model.prepare`) does not build the model's modules."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

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


def __getattr__(name: str) -> object:
    if name not in _WHERE:
        raise AttributeError(f"module 'engine.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
