"""pd-bench engine runs on CPU with small shapes and prints every row beside its ceiling."""

from __future__ import annotations

from tests.unit.benchmarks.bench_run import help_text, run_with_json

SMALL = [
    "--device", "cpu", "--dtype", "float32", "--model", "synthetic:tiny-llama",
    "--floor-model", "synthetic:tiny-llama", "--batch-sizes", "1,3", "--contexts", "40",
    "--prefill-lens", "64", "--steps", "3", "--warmup-steps", "1", "--prefill-iters", "1",
    "--bandwidth-bytes", "16MiB", "--gemm-size", "128",
]  # fmt: skip


def test_engine_bench_small_cpu_run(tmp_path, capsys) -> None:
    table, result = run_with_json("engine", SMALL, tmp_path, capsys)
    for case in ("decode batch 1 ctx 40", "decode batch 3 ctx 40", "prefill 64 tokens",
                 "floor decode batch 1 ctx 128"):  # fmt: skip
        assert case in table
    rows = result["rows"]
    assert len(rows) == 4
    assert all(r["value"] > 0 and r["bound"] > 0 for r in rows)


def test_engine_bench_times_async_scheduled_steps_and_prefills(tmp_path, capsys) -> None:
    """With async scheduling a step() call only launches a prefill: the bench still times the
    prefill until its token is out, and the decode rows per step."""
    table, result = run_with_json("engine", [*SMALL, "--async-scheduling", "on"], tmp_path, capsys)
    assert "async scheduling on" in table
    assert result["info"]["async_scheduling"] is True
    assert len(result["rows"]) == 4 and all(r["value"] > 0 for r in result["rows"])


def test_engine_bench_over_two_ranks_reports_what_tensor_parallelism_costs(
    tmp_path, capsys
) -> None:
    table, result = run_with_json(
        "engine", [*SMALL, "--tensor-parallel-size", "2"], tmp_path, capsys
    )
    assert "tensor parallel size 2: per decode step on rank 0" in table
    costs = result["info"]["tp"]
    assert [c["case"] for c in costs] == ["tiny-llama decode batch 1 ctx 40",
                                          "tiny-llama decode batch 3 ctx 40"]  # fmt: skip
    for c in costs:  # every step broadcasts and all-reduces; both within the step
        assert 0 < c["broadcast_s"] < c["step_s"] and 0 < c["collectives_s"] < c["step_s"]
        assert 0 < c["collective_share"] < 1
    assert len(result["rows"]) == 4  # the floor at TP 1


def test_engine_bench_help_documents_every_option(capsys) -> None:
    text = help_text("engine", capsys)
    for flag in (
        "--model",
        "--floor-model",
        "--batch-sizes",
        "--contexts",
        "--prefill-lens",
        "--steps",
        "--warmup-steps",
        "--bandwidth-bytes",
        "--gemm-size",
        "--json",
        "--attention-backend",
        "--enforce-eager",
        "--async-scheduling",
        "--floor-context",
        "--prefill-iters",
        "--tensor-parallel-size",
        "--devices",
    ):
        assert flag in text  # fmt: skip


def test_engine_bench_puts_verify_steps_beside_decode_steps(tmp_path, capsys) -> None:
    """--num-speculative-tokens K: a K + 1-token verify step per batch and context, its
    ceiling column the plain decode step of the same engine."""
    argv = [*SMALL, "--prefill-lens", "", "--floor-model", "", "--num-speculative-tokens", "2"]
    table, result = run_with_json("engine", argv, tmp_path, capsys)
    rows = {r["case"]: r for r in result["rows"]}
    for batch in (1, 3):
        decode = rows[f"tiny-llama decode batch {batch} ctx 40"]
        verify = rows[f"tiny-llama verify K=2 batch {batch} ctx 40"]
        assert verify["bound"] == decode["value"] and verify["value"] > 0
    assert "verify K=2 batch 3 ctx 40" in table and len(rows) == 4
