"""Structured outputs: the grammar engine (llguidance) behind a small interface.

`StructuredOutputManager` compiles and caches specs (off the engine thread, under a time
limit); a request carries its `CompiledGrammar` and, once added, its own `GrammarMatcher`;
`TokenBitmask` turns a step's matchers into the `GrammarMask` the sampler applies. README.md
says how they fit the engine, async scheduling and the PD hand-off.
"""

from engine.structured.grammar_compiler import (
    CompiledGrammar,
    GrammarCompiler,
    load_grammar_compiler,
)
from engine.structured.grammar_matcher import GrammarMatcher
from engine.structured.structured_output_manager import (
    StructuredOutputBusyError,
    StructuredOutputConfig,
    StructuredOutputManager,
)
from engine.structured.token_bitmask import GrammarMask, TokenBitmask, apply_grammar_mask

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarMask",
    "GrammarMatcher",
    "StructuredOutputBusyError",
    "StructuredOutputConfig",
    "StructuredOutputManager",
    "TokenBitmask",
    "apply_grammar_mask",
    "load_grammar_compiler",
]
