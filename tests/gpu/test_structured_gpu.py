"""Structured outputs on CUDA: the masks applied on the GPU, decode graphs replayed, async
scheduling deferring a constrained step's sampling: every corpus schema's output validates on
the default model, greedy and seeded, with and without async scheduling. Skipped without
CUDA; the logic, and that async scheduling gives the synchronous tokens (CPU, where batches of
different sizes give bitwise the same rows), are tested in tests/unit/engine/structured/."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from pdserve.structured_output import StructuredOutputParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available"),
]
CORPUS = Path(__file__).parents[2] / "benchmarks" / "data" / "structured_outputs.json"


def schemas() -> dict:
    return json.loads(CORPUS.read_text(encoding="utf-8"))["json_schemas"]


def run(mode: str) -> tuple[LLM, list]:
    llm = LLM("smollm2-135m", device="cuda", dtype="float32", async_scheduling=mode)
    assert llm.engine.runner.token_bitmask is not None
    conversations, params = [], []
    for name, schema in schemas().items():
        spec = StructuredOutputParams.json_schema(schema)
        for sampled in (False, True):
            conversations.append([{"role": "user", "content": f"JSON for: {name}"}])
            params.append(
                SamplingParams(
                    max_tokens=160,
                    temperature=0.8 if sampled else 0.0,
                    seed=7,
                    structured_output=spec,
                )  # fmt: skip
            )
    outputs = llm.chat(conversations, params)
    llm.engine.check_no_leaks()
    return llm, outputs


@pytest.mark.parametrize("mode", ["off", "on"])
def test_every_schema_validates_on_cuda(mode: str) -> None:
    llm, outputs = run(mode)
    names = [name for name in schemas() for _ in range(2)]
    for name, output in zip(names, outputs):
        assert output.finish_reason == "stop", (name, output.text)
        jsonschema.validate(json.loads(output.text), schemas()[name])
    if mode == "on":
        assert llm.engine.num_steps_ahead > 0
