"""`GrammarCompiler`: a structured-output spec -> `CompiledGrammar`, with llguidance, for one
tokenizer. Blocking; `StructuredOutputManager` runs it off the engine thread under a time limit.

```
StructuredOutputParams ─ grammar_text ─► llguidance grammar (JSON schema, regex, Lark)
  ─ LLMatcher(tokenizer, grammar, limits) ─► the first token mask ─► CompiledGrammar
```

llguidance builds its lexer lazily, so a spec is compiled only once its first mask is filled:
that is when its limits (`LLParserLimits`: lexer fuel, states, grammar size) refuse a hostile
spec, and the matchers later copied from the template start warm. Matcher construction and
mask computation release the GIL; the spec -> grammar conversion holds it (bounded by
`MAX_SPEC_BYTES`, pdserve/structured_output.py).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import llguidance
import llguidance.torch
import torch

from engine.structured.grammar_matcher import GrammarMatcher
from engine.structured.token_bytes import build_ll_tokenizer
from pdserve.sampling_params import InvalidRequestError
from pdserve.structured_output import StructuredOutputKind, StructuredOutputParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# Compact JSON: no free whitespace, so a bounded schema bounds the output's length (a small
# model given free whitespace may emit it forever).
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
_JSON_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled spec: the matcher template every request of that spec copies."""

    digest: str  # StructuredOutputParams.digest
    kind: StructuredOutputKind
    template: llguidance.LLMatcher  # in its start state, never advanced
    eos_token_ids: tuple[int, ...]
    compile_s: float

    def new_matcher(self, accepted: Sequence[int] = ()) -> GrammarMatcher:
        """A request's own matcher (microseconds: a copy of the template), advanced by the
        output tokens it already has: the first token a prefill node sampled under this
        grammar, a migrated request's tokens. InvalidRequestError if the grammar refuses one."""
        matcher = GrammarMatcher(self.template.deep_copy(), self.eos_token_ids)
        if accepted and matcher.accept_tokens(accepted) < len(accepted):
            num = matcher.num_accepted_tokens
            raise InvalidRequestError(
                f"structured output: output token {num} ({accepted[num]}) does not follow the "
                f"{self.kind.value}; the request cannot continue under it",
                "structured_output",
            )
        return matcher


def grammar_text(params: StructuredOutputParams) -> str:
    """llguidance's grammar for `params` (its top-level JSON form)."""
    matcher_type = llguidance.LLMatcher
    kind = params.kind
    try:
        if kind is StructuredOutputKind.JSON_SCHEMA:
            return matcher_type.grammar_from_json_schema(params.spec, defaults=_JSON_OPTIONS)
        if kind is StructuredOutputKind.JSON_OBJECT:
            return matcher_type.grammar_from_json_schema(
                _JSON_OBJECT_SCHEMA, defaults=_JSON_OPTIONS
            )
        if kind is StructuredOutputKind.REGEX:
            return matcher_type.grammar_from_regex(params.spec)
        if kind is StructuredOutputKind.GRAMMAR:
            return matcher_type.grammar_from_lark(params.spec)
    except ValueError as error:
        raise _refused(kind, str(error)) from None
    # choice: one Lark alternative per string, each a JSON-escaped literal
    return matcher_type.grammar_from_lark(
        "start: " + " | ".join(json.dumps(choice) for choice in params.choices) + "\n"
    )


def _refused(kind: StructuredOutputKind, error: str) -> InvalidRequestError:
    first_line = error.strip().splitlines()[0] if error.strip() else "refused"
    return InvalidRequestError(
        f"structured output: the {kind.value} cannot be compiled: {first_line[:300]}",
        "structured_output",
    )


class GrammarCompiler:
    """llguidance's tokenizer for one model, and compilation against it."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        """`tokenizer_json`: the text of a Hugging Face tokenizer.json; `vocab_size`: the
        model's (it may exceed the tokenizer's: ids beyond it are never allowed)."""
        if not eos_token_ids:
            raise ValueError("structured outputs need the model's EOS token ids")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = build_ll_tokenizer(tokenizer_json, vocab_size, eos_token_ids)
        # The library's defaults bound each step's work; errors stay terse (no grammar dump).
        self.limits = llguidance.LLParserLimits(verbose_errors=False)

    def compile(self, params: StructuredOutputParams) -> CompiledGrammar:
        """Compile `params` and fill its first mask; InvalidRequestError names what the
        library refused (a syntax error, an unknown $ref, a limit)."""
        start = time.perf_counter()
        text = grammar_text(params)
        template = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=self.limits)
        if not template.is_error():  # the first mask: warms the lexer the copies share
            scratch = torch.empty((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
            llguidance.torch.fill_next_token_bitmask(template, scratch, 0)
        error = template.get_error()
        if error:
            raise _refused(params.kind, error)
        return CompiledGrammar(
            params.digest, params.kind, template, self.eos_token_ids, time.perf_counter() - start
        )


@functools.lru_cache(maxsize=4)
def load_grammar_compiler(
    tokenizer_path: Path, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> GrammarCompiler:
    """One `GrammarCompiler` per tokenizer file, vocabulary and EOS ids in the process: its
    setup (~0.3 s of CPU for a 49k vocabulary, holding the GIL) is paid once."""
    text = tokenizer_path.read_text(encoding="utf-8")
    return GrammarCompiler(text, vocab_size, eos_token_ids)
