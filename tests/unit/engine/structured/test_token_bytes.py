"""llguidance's tokenizer decodes as the model's tokenizer does, also where llguidance misreads
the tokenizer.json (the decoder transformers 5.17's GGUF conversion writes), or refuses."""

from __future__ import annotations

import json

import llguidance
import pytest
import tokenizers

from engine.structured import token_bytes
from engine.structured.token_bytes import build_ll_tokenizer, decoding_misfit
from tests.unit.engine.structured.conftest import EOS, VOCAB_SIZE

NEWLINE = 198  # SmolLM2's byte-level "Ċ": the byte 0x0A
# The decoder transformers 5.17 wrote for SmolLM2 (5.24 writes a plain ByteLevel decoder).
MISREAD_DECODER = {
    "type": "Sequence",
    "decoders": [
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    ],
}


@pytest.fixture(scope="module")
def tokenizer_json(smollm2_dir) -> str:
    return (smollm2_dir / "tokenizer.json").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def misread_json(tokenizer_json) -> str:
    spec = json.loads(tokenizer_json)
    spec["decoder"] = MISREAD_DECODER
    return json.dumps(spec)


def string_matcher(ll: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "string"})
    return llguidance.LLMatcher(ll, grammar, log_level=0)


def test_the_default_tokenizer_is_read_as_it_is(tokenizer_json) -> None:
    ll = build_ll_tokenizer(tokenizer_json, VOCAB_SIZE, [EOS])
    assert decoding_misfit(ll, tokenizers.Tokenizer.from_str(tokenizer_json)) is None
    assert ll.decode_bytes([NEWLINE]) == b"\n"


def test_a_misread_decoder_is_caught_and_rebuilt_from_token_bytes(misread_json) -> None:
    hf = tokenizers.Tokenizer.from_str(misread_json)
    plain = llguidance.LLTokenizer(misread_json, n_vocab=VOCAB_SIZE, eos_token=[EOS])
    assert plain.decode_bytes([NEWLINE]) == b"\xc4\x8a"  # the misreading this module guards
    assert decoding_misfit(plain, hf) is not None
    # a JSON string admits the raw newline under the misread tokenizer, not under the rebuilt
    quote, letter = hf.token_to_id('"'), hf.token_to_id("a")
    assert quote is not None and letter is not None
    assert string_matcher(plain).try_consume_tokens([quote, letter, NEWLINE]) == 3
    rebuilt = build_ll_tokenizer(misread_json, VOCAB_SIZE, [EOS])
    assert rebuilt.decode_bytes([NEWLINE]) == b"\n"
    assert decoding_misfit(rebuilt, hf) is None
    assert string_matcher(rebuilt).try_consume_tokens([quote, letter, NEWLINE]) == 2


def test_a_tokenizer_misread_both_ways_is_refused(misread_json, monkeypatch) -> None:
    monkeypatch.setattr(token_bytes, "_token_to_bytes", lambda _: lambda piece: piece.encode())
    with pytest.raises(ValueError, match="decodes its tokens differently"):
        build_ll_tokenizer(misread_json, VOCAB_SIZE, [EOS])
