"""pd-bench profile runs on CPU with a tiny model: every phase timed, the op table filled."""

from __future__ import annotations

from benchmarks.engine.profile_step import PHASES
from tests.unit.benchmarks.bench_run import help_text, run_with_json

SMALL = [
    "--device", "cpu", "--dtype", "float32", "--model", "synthetic:tiny-llama",
    "--batch-sizes", "1,3", "--context", "20", "--steps", "2", "--warmup-steps", "1",
    "--profile-steps", "1", "--top", "5",
]  # fmt: skip


def test_profile_small_cpu_run(tmp_path, capsys) -> None:
    report, result = run_with_json("profile", SMALL, tmp_path, capsys)
    assert (
        "| batch | step ms | engine step ms | schedule | inputs | forward | sample | outputs | "
        "detok |" in report
    )
    assert "batch 3: top 5" in report
    assert result["info"]["layer_ops"] == "reference"
    batches = result["batches"]
    assert [b["batch"] for b in batches] == [1, 3]
    for b in batches:
        assert set(b["phase_ms"]) == set(PHASES)
        assert b["phase_ms"]["forward"] > 0 and b["phase_ms"]["sample"] > 0
        assert b["step_ms"] >= b["phase_ms"]["forward"]
        assert b["engine_step_ms"] > 0
        assert b["kernels_per_step"] > 0 and len(b["top"]) == 5
        assert all(k["name"].startswith("aten::") and k["calls_per_step"] > 0 for k in b["top"])


def test_profile_help_documents_every_option(capsys) -> None:
    text = help_text("profile", capsys)
    for flag in ("--model", "--dtype", "--device", "--attention-backend", "--enforce-eager",
                 "--batch-sizes", "--context", "--steps", "--warmup-steps", "--profile-steps",
                 "--top", "--sync", "--trace", "--json"):  # fmt: skip
        assert flag in text
