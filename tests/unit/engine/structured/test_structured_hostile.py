"""Hostile specs: refused with a message naming the problem (by the cheap checks, the grammar
library's limits, or the time limit), while the engine keeps stepping other requests."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.engine_core import EngineCore
from engine.structured import StructuredOutputConfig, StructuredOutputManager
from pdserve.config import EngineConfig, ModelConfig
from pdserve.sampling_params import InvalidRequestError, SamplingParams
from pdserve.structured_output import StructuredOutputParams
from tests.child_env import child_env
from tests.unit.engine.structured.test_structured_output_manager import WAIT_S, BlockingCompiler

DEPTH = 3000
HOSTILE = {
    "deep nesting": lambda: StructuredOutputParams.json_schema(
        '{"type":"object","properties":{"a":' * DEPTH + "{}" + "}}" * DEPTH
    ),
    "huge enum": lambda: StructuredOutputParams.json_schema({"enum": list(range(200_000))}),
    "many properties": lambda: StructuredOutputParams.json_schema(
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}}
    ),
    "regex repeat bomb": lambda: StructuredOutputParams.regex("((x{1000}){1000}){1000}"),
    "pattern repeat bomb": lambda: StructuredOutputParams.json_schema(
        {"type": "string", "pattern": "(a{1000}){1000}"}
    ),
    "invalid regex": lambda: StructuredOutputParams.regex("(unclosed[a-"),
    "unknown $ref": lambda: StructuredOutputParams.json_schema({"$ref": "#/$defs/nothing"}),
    "lark syntax": lambda: StructuredOutputParams.grammar("start: ( unbalanced\n"),
    "not json": lambda: StructuredOutputParams.json_schema("{'type': 'object'"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_specs_are_refused(compiler, name):
    manager = StructuredOutputManager(compiler)
    with pytest.raises(InvalidRequestError) as refused:
        manager.compile(SamplingParams(structured_output=HOSTILE[name]()))  # or its check
    assert refused.value.param == "structured_output"
    assert manager.num_compiling == 0


DEEP_GRAMMARS = {  # within the caps; grammar construction recurses once per level
    "json $ref chain": lambda: StructuredOutputParams.json_schema(
        {
            "$defs": {
                f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}, "maxItems": 1}
                for i in range(1500)
            }
            | {"d1500": {"type": "integer"}},
            "$ref": "#/$defs/d0",
        }
    ),
    "lark rule chain": lambda: StructuredOutputParams.grammar(
        "start: r0\n" + "".join(f'r{i}: "t" r{i + 1}?\n' for i in range(4000)) + 'r4000: "e"\n'
    ),
}
_WALK = """
import sys, torch
from tests.unit.engine.structured import test_structured_hostile as t
from engine.structured import StructuredOutputManager, load_grammar_compiler
from pdserve.sampling_params import SamplingParams
compiler = load_grammar_compiler(t.Path(sys.argv[2]), 49152, (2,))
manager = StructuredOutputManager(compiler)
grammar = manager.compile(SamplingParams(structured_output=t.DEEP_GRAMMARS[sys.argv[1]]()))
matcher, mask = grammar.new_matcher(), torch.empty((1, 1536), dtype=torch.int32)
for _ in range(20):  # masks and tokens on this (main, 8 MiB stack) thread
    matcher.fill_bitmask(mask, 0)
    bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = torch.nonzero(bits.view(-1)).view(-1).tolist()
    if matcher.is_terminated or not matcher.accept_token(allowed[0]):
        break
print("walked", matcher.num_accepted_tokens, repr(matcher.error))
"""


@pytest.mark.parametrize("name", sorted(DEEP_GRAMMARS))
def test_deep_grammars_compile_without_overflowing_a_stack(smollm2_dir, name):
    """They segfault on an 8 MiB stack (the compile threads have 256 MiB); in a child process,
    so that a regression fails this test, not the whole session."""
    assert len(DEEP_GRAMMARS[name]().spec) < 128 * 1024  # the cheap checks let it through
    child = subprocess.run(
        [sys.executable, "-c", _WALK, name, str(smollm2_dir / "tokenizer.json")],
        capture_output=True, text=True, timeout=WAIT_S * 5,
        cwd=Path(__file__).parents[4], env=child_env(),
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.startswith("walked") and "''" in child.stdout


def test_a_compile_in_progress_never_delays_other_requests(compiler):
    engine = EngineCore(EngineConfig(model=ModelConfig(model="synthetic:tiny-llama", device="cpu")))
    slow = BlockingCompiler(compiler)  # a compile that ends only when the test says so
    engine.structured = StructuredOutputManager(slow, StructuredOutputConfig(compile_timeout_s=0.2))
    refused: list[Exception] = []

    def ask() -> None:
        params = SamplingParams(structured_output=StructuredOutputParams.regex("[a-z]+"))
        try:
            engine.structured.compile(params)
        except InvalidRequestError as error:
            refused.append(error)

    asker = threading.Thread(target=ask)
    asker.start()
    assert slow.started.wait(WAIT_S)
    engine.add_request(engine.make_request("free", [5, 6, 7], SamplingParams(max_tokens=8)))
    num_tokens = 0
    while engine.has_unfinished():
        num_tokens += sum(len(out.new_token_ids) for out in engine.step())
    assert num_tokens == 8 and not slow.release.is_set()  # every step ran while it compiled
    asker.join(WAIT_S)
    assert len(refused) == 1 and "took longer than 0.2 s" in str(refused[0])
    assert not slow.release.is_set()  # refused by the limit, not by the compile's end
    slow.release.set()
    engine.check_no_leaks()
