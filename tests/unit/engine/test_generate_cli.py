"""pd-generate (engine/cli.py): the tensor-parallel flags come from ParallelConfig."""

from __future__ import annotations

import pytest

from engine.cli import build_parser, main
from pdserve.cli import config_from_args
from pdserve.config import ParallelConfig


def test_the_tensor_parallel_flags_are_parsed_into_the_config() -> None:
    args = build_parser().parse_args(
        ["--tensor-parallel-size", "2", "--devices", "cuda:0,cuda:1", "hi"]
    )
    parallel = config_from_args(ParallelConfig, args)
    assert parallel == ParallelConfig(tensor_parallel_size=2, devices="cuda:0,cuda:1")


def test_a_size_the_model_cannot_split_is_refused_with_its_sizes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--tensor-parallel-size", "2", "--device", "cpu", "hi"]) == 2
    error = capsys.readouterr().err
    assert "tensor_parallel_size 2 does not split smollm2-135m" in error
    assert "9 attention heads, 3 kv heads" in error
