"""The project's top-level packages import from this checkout. `kernels` and `router` are
also names of other PyPI distributions, which must not shadow ours."""

from __future__ import annotations

import importlib
import importlib.metadata
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "engine",
    "kernels",
    "cache_transfer",
    "node_common",
    "prefill_node",
    "decode_node",
    "router",
    "pdserve",
    "pdserve.v1",
)


@pytest.mark.parametrize("name", PACKAGES)
def test_package_resolves_to_this_repo(name: str) -> None:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as error:
        pytest.fail(f"`import {name}` failed ({error}): install this project (pip install -e .)")
    assert module.__file__ is not None, (
        f"{name} is a namespace package spread over {list(module.__path__)}: "
        f"add {name.replace('.', '/')}/__init__.py"
    )
    path = Path(module.__file__).resolve()
    assert path.is_relative_to(REPO_ROOT), (
        f"`import {name}` loads {path}, outside {REPO_ROOT}: another distribution provides "
        f"`{name}`; uninstall it, or install this project (pip install -e .)"
    )


@pytest.mark.parametrize("name", ["kernels", "router", "proto"])
def test_no_other_installed_distribution_provides_our_top_level_names(name: str) -> None:
    """Another distribution's package of the same name is shadowed by ours; whatever imports it
    then fails (transformers 5.25 requires Hugging Face's `kernels`)."""
    providers = set(importlib.metadata.packages_distributions().get(name, [])) - {"pdserve"}
    assert not providers, (
        f"{sorted(providers)} also install(s) a top-level `{name}` package, which this project's "
        f"{name}/ shadows: uninstall it, or pin what requires it (pyproject.toml, constraints.txt)"
    )
