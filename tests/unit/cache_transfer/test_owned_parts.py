"""cache_transfer/ composes, it does not mix in: every class has at most one base class, so a
session's parts (InPlaceWrites, InPlaceGrant, LayerSpans...) are objects it owns and calls
through their own small interface, never attributes of a class chain (issue 33)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "cache_transfer"


def test_no_class_in_cache_transfer_has_more_than_one_base() -> None:
    mixed = [
        f"{path.relative_to(PACKAGE.parent)}: {node.name}({', '.join(map(ast.unparse, node.bases))})"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef) and len(node.bases) > 1
    ]
    assert PACKAGE.is_dir() and not mixed, mixed
