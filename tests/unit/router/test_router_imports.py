"""The router starts without torch and imports only what ARCHITECTURE.md allows."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROUTER_DIR = Path(__file__).resolve().parents[3] / "router"
# pdserve (wire schemas, CLI builder, envs) and, as the one documented exception, the engine's
# torch-free text modules.
ALLOWED_PROJECT_MODULES = {
    "pdserve",
    "engine.tokenizer",
    "engine.detokenizer",
    "engine.sampling_params",
}
ALLOWED_THIRD_PARTY = {"grpc", "grpc_health", "grpc_reflection"}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module)
    return names


def _allowed(name: str) -> bool:
    top = name.split(".")[0]
    if top == "router" or top in sys.stdlib_module_names or top in ALLOWED_THIRD_PARTY:
        return True
    return any(name == m or name.startswith(m + ".") for m in ALLOWED_PROJECT_MODULES)


@pytest.mark.parametrize("path", sorted(ROUTER_DIR.glob("*.py")), ids=lambda p: p.name)
def test_router_modules_import_only_allowed_modules(path: Path) -> None:
    forbidden = sorted(name for name in _imports(path) if not _allowed(name))

    assert not forbidden, f"router/{path.name} imports {forbidden}; see router/README.md"


def test_the_scan_catches_forbidden_imports() -> None:
    assert not _allowed("engine.engine_core") and not _allowed("torch")
    assert not _allowed("cache_transfer.protocol") and not _allowed("numpy")
    assert _allowed("engine.tokenizer") and _allowed("pdserve.v1.node_pb2")


def test_router_imports_without_torch() -> None:
    code = (
        "import sys, router.server, router.cli, router.client_cli; "
        "print(sorted(m for m in ('torch', 'numpy', 'engine.engine_core') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )

    assert result.stdout.strip() == "[]"
