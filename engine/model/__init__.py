"""Model sources (HF folder, GGUF, `synthetic:<shape>`, aliases) and the Llama-family model."""

from engine.model.arch_config import ModelArchConfig
from engine.model.loader import LoadedModel, load_model, resolve_device, resolve_dtype

__all__ = ["LoadedModel", "ModelArchConfig", "load_model", "resolve_device", "resolve_dtype"]
