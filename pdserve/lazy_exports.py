"""`lazy_exports`: a package's public names, each imported from its module on first use
(PEP 562's module `__getattr__`), so that importing one submodule does not import them all.

    __getattr__ = lazy_exports(__name__, {"LLM": "engine.llm", ...})
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, where: Mapping[str, str]) -> Callable[[str], object]:
    """A module `__getattr__` that takes each name in `where` from the module named there."""

    def __getattr__(name: str) -> object:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name]), name)

    return __getattr__
