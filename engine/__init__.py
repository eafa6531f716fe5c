"""pdserve engine: the role-agnostic runtime (see engine/README.md).

`from engine import LLM, SamplingParams` is the offline API. Imports are lazy so that
torch-free modules (tokenizer, detokenizer, sampling params) load without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.sampling_params import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from engine.engine_core import EngineCore
    from engine.llm import LLM

__all__ = ["LLM", "EngineCore", "SamplingParams", "InvalidRequestError"]


def __getattr__(name: str):
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "EngineCore":
        from engine.engine_core import EngineCore

        return EngineCore
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
