"""pd-bench kv-offload runs on CPU with small shapes: four rows beside their ceilings, the
promoted and demoted blocks byte-exact."""

from __future__ import annotations

from tests.unit.benchmarks.bench_run import help_text, run_with_json

SMALL = ["--device", "cpu", "--dtype", "float32", "--model", "synthetic:tiny-llama",
         "--tokens", "128", "--iters", "1"]  # fmt: skip


def test_kv_offload_bench_small_cpu_run(tmp_path, capsys) -> None:
    table, result = run_with_json("kv-offload", SMALL, tmp_path, capsys)
    cases = ["host -> device copy", "promotion", "device -> host copy", "demotion"]
    assert [row["case"] for row in result["rows"]] == cases
    assert all(row["seconds"] > 0 and row["num_bytes"] > 0 for row in result["rows"])
    assert result["info"]["byte_exact"] is True
    assert result["info"]["num_blocks"] == 8  # 128 tokens / 16
    assert "of the host -> device rate" in table and "byte-exact: yes" in table


def test_kv_offload_bench_help_documents_every_option(capsys) -> None:
    text = help_text("kv-offload", capsys)
    for flag in ("--model", "--dtype", "--device", "--block-size", "--tokens", "--iters", "--json"):
        assert flag in text
