"""A request's matcher on the real tokenizer: accepting, validating and rolling back tokens,
the mask, termination; the compiler's refusals."""

from __future__ import annotations

import pytest
import torch

from engine.structured import GrammarMatcher
from pdserve.sampling_params import InvalidRequestError
from pdserve.structured_output import StructuredOutputParams
from tests.unit.engine.structured.conftest import EOS, VOCAB_SIZE


def allowed(matcher: GrammarMatcher) -> set[int]:
    bitmask = torch.zeros((2, (VOCAB_SIZE + 31) // 32), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 1)
    bits = (bitmask[1].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(torch.nonzero(bits.view(-1)[:VOCAB_SIZE]).view(-1).tolist())


def test_a_complete_output_terminates_the_matcher(compiler, smollm2_tokenizer):
    matcher = compiler.compile(StructuredOutputParams.regex(r"\d{3}-\d{4}")).new_matcher()
    tokens = smollm2_tokenizer.encode("555-1234", add_special_tokens=False)
    assert matcher.accept_tokens(tokens) == len(tokens)
    # nothing can follow: the output ends here, without an EOS token
    assert matcher.is_terminated and not matcher.error


def test_an_output_that_may_go_on_ends_with_eos(compiler, smollm2_tokenizer):
    matcher = compiler.compile(StructuredOutputParams.regex("[0-9]+")).new_matcher()
    assert matcher.accept_tokens(smollm2_tokenizer.encode("12", add_special_tokens=False))
    next_tokens = allowed(matcher)
    assert EOS in next_tokens and smollm2_tokenizer.encode("3", add_special_tokens=False)[0] in (
        next_tokens
    )
    assert matcher.accept_token(EOS)
    assert matcher.is_terminated and not matcher.error


def test_validate_accept_and_rollback(compiler, smollm2_tokenizer):
    matcher = compiler.compile(StructuredOutputParams.regex("[a-z]+ [0-9]+")).new_matcher()
    good = smollm2_tokenizer.encode("hello 42", add_special_tokens=False)
    bad = smollm2_tokenizer.encode("hello X", add_special_tokens=False)
    num_valid = matcher.validate_tokens(bad)
    assert 0 < num_valid < len(bad)
    assert matcher.num_accepted_tokens == 0  # validating advances nothing
    assert matcher.accept_tokens(bad) == num_valid  # the valid prefix; still usable
    assert not matcher.is_terminated and not matcher.error
    matcher.rollback(num_valid)
    assert matcher.num_accepted_tokens == 0
    assert matcher.accept_tokens(good) == len(good)
    with pytest.raises(ValueError, match="cannot roll back"):
        matcher.rollback(len(good) + 1)


def test_the_mask_allows_exactly_the_grammar(compiler, smollm2_tokenizer):
    matcher = compiler.compile(StructuredOutputParams.choice(["yes", "no"])).new_matcher()
    first = allowed(matcher)
    for word in ("yes", "no"):
        assert smollm2_tokenizer.encode(word, add_special_tokens=False)[0] in first
    assert smollm2_tokenizer.encode("maybe", add_special_tokens=False)[0] not in first
    assert EOS not in first
    assert matcher.accept_tokens(smollm2_tokenizer.encode("no", add_special_tokens=False))
    assert matcher.is_terminated and not matcher.error


def test_a_refused_token_fails_the_matcher(compiler, smollm2_tokenizer):
    matcher = compiler.compile(StructuredOutputParams.choice(["yes", "no"])).new_matcher()
    assert not matcher.accept_token(smollm2_tokenizer.encode("maybe", add_special_tokens=False)[0])
    assert matcher.is_terminated and matcher.error


def test_new_matcher_advanced_by_the_output_so_far(compiler, smollm2_tokenizer):
    grammar = compiler.compile(StructuredOutputParams.json_object())
    prefix = smollm2_tokenizer.encode('{"a":', add_special_tokens=False)
    matcher = grammar.new_matcher(prefix)
    assert matcher.num_accepted_tokens == len(prefix)
    with pytest.raises(InvalidRequestError, match="does not follow the json_object"):
        grammar.new_matcher(smollm2_tokenizer.encode("plain text", add_special_tokens=False))


def test_matchers_of_one_grammar_are_independent(compiler, smollm2_tokenizer):
    grammar = compiler.compile(StructuredOutputParams.regex("(ab)+"))
    one, two = grammar.new_matcher(), grammar.new_matcher()
    one.accept_tokens(smollm2_tokenizer.encode("abab", add_special_tokens=False))
    assert two.num_accepted_tokens == 0 and allowed(two) != allowed(one)


@pytest.mark.parametrize(
    ("params", "words"),
    [
        (StructuredOutputParams.regex("(unclosed[a-"), "regex cannot be compiled"),
        (StructuredOutputParams.json_schema({"$ref": "#/$defs/missing"}), "cannot be compiled"),
        (StructuredOutputParams.grammar("start: missing_rule\n"), "grammar cannot be compiled"),
        (StructuredOutputParams.json_schema({"type": "strange"}), "cannot be compiled"),
    ],
)
def test_the_library_refusals_name_the_problem(compiler, params, words):
    with pytest.raises(InvalidRequestError, match=words) as refused:
        compiler.compile(params)
    assert refused.value.param == "structured_output"
