"""The router starts without torch (the import rules themselves are contracts in pyproject.toml,
checked by tests/unit/test_architecture.py)."""

from __future__ import annotations

import subprocess
import sys


def test_router_imports_without_torch() -> None:
    code = (
        "import sys, router.server, router.cli, router.client_cli; "
        "print(sorted(m for m in ('torch', 'numpy', 'engine.engine_core') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )

    assert result.stdout.strip() == "[]"
