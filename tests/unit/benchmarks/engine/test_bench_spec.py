"""pd-bench spec runs the default model with and without prompt lookup on a prompt of the
grounded dataset and reports the same outputs, both rates and the drafts accepted."""

from __future__ import annotations

import pytest

from tests.unit.benchmarks.bench_run import help_text, run_with_json

pytestmark = pytest.mark.slow


def test_spec_bench_small_cpu_run(tmp_path, capsys) -> None:
    argv = ["--num-prompts", "2", "--max-tokens", "24"]
    table, result = run_with_json("spec", argv, tmp_path, capsys)
    assert result["num_prompts"] == 2 and result["same_outputs"] == 2
    assert result["plain"]["output_tokens"] == result["spec"]["output_tokens"] > 0
    assert result["num_verifies"] > 0 and 0 <= result["acceptance_rate"] <= 1
    assert "| no speculation |" in table and "ngram K=4" in table


def test_spec_bench_help_documents_every_option(capsys) -> None:
    text = help_text("spec", capsys)
    for flag in ("--dataset", "--num-prompts", "--max-tokens", "--speculative-method",
                 "--num-speculative-tokens", "--speculative-model", "--async-scheduling"):  # fmt: skip
        assert flag in text
