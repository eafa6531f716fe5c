"""Speculative decoding's knobs (SpeculativeConfig, flags generated from it) and the
per-request opt-out across the wire."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser, engine_config
from pdserve.config import EngineConfig, SpeculativeConfig
from pdserve.sampling_params import SamplingParams
from pdserve.v1 import generation_pb2, node_pb2


def test_flags_parse_into_the_speculative_section() -> None:
    args = build_parser("decode").parse_args(
        ["--speculative-method", "draft", "--speculative-model", "synthetic:tiny-llama",
         "--num-speculative-tokens", "3", "--ngram-prompt-lookup-max", "5"]
    )  # fmt: skip
    spec = engine_config(args).speculative
    assert (spec.speculative_method, spec.speculative_model) == ("draft", "synthetic:tiny-llama")
    assert (spec.num_speculative_tokens, spec.ngram_prompt_lookup_max) == (3, 5)
    assert EngineConfig().speculative.speculative_method is None  # off by default


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(speculative_method="medusa"), "speculative_method must be one of"),
        (dict(speculative_method="ngram", num_speculative_tokens=0), r"in \[1, 16\]"),
        (dict(speculative_method="draft"), "--speculative-model goes with"),
        (dict(speculative_method="ngram", speculative_model="x"), "--speculative-model goes with"),
        (dict(ngram_prompt_lookup_min=3, ngram_prompt_lookup_max=2), "ngram_prompt_lookup_min"),
    ],
)
def test_bad_settings_say_what_to_fix(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)


def test_speculation_under_tensor_parallelism_is_refused_naming_both_knobs() -> None:
    args = build_parser("decode").parse_args(
        ["--speculative-method", "ngram", "--tensor-parallel-size", "2"]
    )
    with pytest.raises(ValueError, match="--speculative-method ngram.*--tensor-parallel-size 2"):
        engine_config(args)
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        EngineConfig.from_kwargs(speculative_method="ngram", tensor_parallel_size=2)
    assert EngineConfig.from_kwargs(tensor_parallel_size=2).parallel.tensor_parallel_size == 2


def test_the_opt_out_crosses_the_wire() -> None:
    assert SamplingParams().speculative is True
    for message_type in (generation_pb2.SamplingParams, node_pb2.NodeSamplingParams):
        off = SamplingParams(speculative=False).to_proto(message_type)
        assert SamplingParams.from_proto(off).speculative is False
        unset = message_type()
        assert not unset.HasField("speculative")
        assert SamplingParams.from_proto(unset).speculative is True
