"""pdserve engine: the role-agnostic runtime (see engine/README.md).

`from engine import LLM, SamplingParams` is the offline API. Its names load on first use
(PEP 562): a process that needs one submodule (`python -m engine.model.prepare`, which pd-serve
runs before every start) does not import the whole engine with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from engine.engine_core import EngineCore
    from engine.llm import LLM
    from pdserve.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "EngineCore", "SamplingParams", "InvalidRequestError"]

_WHERE = {
    "LLM": "engine.llm",
    "EngineCore": "engine.engine_core",
    "SamplingParams": "pdserve.sampling_params",
    "InvalidRequestError": "pdserve.sampling_params",
}

__getattr__ = lazy_exports(__name__, _WHERE)
