"""pdserve engine: the role-agnostic runtime (see engine/README.md).

`from engine import LLM, SamplingParams` is the offline API.
"""

from __future__ import annotations

from engine.engine_core import EngineCore
from engine.llm import LLM
from pdserve.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "EngineCore", "SamplingParams", "InvalidRequestError"]
