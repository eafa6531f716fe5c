"""Runs a `pd-bench` command in-process for the benchmark tests: its printed report and the
JSON file it wrote, or its --help text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.cli import main as pd_bench


def run_with_json(command: str, argv: list[str], tmp_path: Path, capsys) -> tuple[str, dict]:
    """`pd-bench COMMAND ARGV --json FILE`: it exits 0; its stdout and the parsed FILE."""
    out = tmp_path / f"{command}.json"
    assert pd_bench([command, *argv, "--json", str(out)]) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def help_text(command: str, capsys) -> str:
    """`pd-bench COMMAND --help`: it exits 0; the text it printed."""
    with pytest.raises(SystemExit) as exit_info:
        pd_bench([command, "--help"])
    assert exit_info.value.code in (0, None)
    return capsys.readouterr().out
