"""The batch's grammar masks: built for the constrained rows only, applied on the logits."""

from __future__ import annotations

import torch

from engine.structured import GrammarMask, TokenBitmask, apply_grammar_mask
from pdserve.structured_output import StructuredOutputParams
from tests.unit.engine.structured.conftest import VOCAB_SIZE


def test_apply_grammar_mask_matches_a_bit_by_bit_reference():
    gen = torch.Generator().manual_seed(0)
    vocab_size, num_rows = 100, 5  # 100 ids: the last word is partly padding
    logits = torch.randn(num_rows, vocab_size, generator=gen)
    bits = torch.randint(-(2**31), 2**31 - 1, (2, 4), generator=gen, dtype=torch.int64)
    mask = GrammarMask(rows=torch.tensor([1, 3]), bits=bits.to(torch.int32))
    masked = apply_grammar_mask(logits, mask)
    expected = logits.clone()
    for j, row in enumerate([1, 3]):
        for token in range(vocab_size):
            word = int(mask.bits[j, token // 32]) & 0xFFFFFFFF
            if not (word >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    assert torch.equal(masked, expected)
    assert torch.isfinite(logits).all()  # the raw logits are left as they were


def test_build_covers_the_constrained_rows_only(compiler, smollm2_tokenizer):
    grammar = compiler.compile(StructuredOutputParams.choice(["alpha", "beta"]))
    finished = grammar.new_matcher(smollm2_tokenizer.encode("beta", add_special_tokens=False))
    assert finished.is_terminated
    builder = TokenBitmask(VOCAB_SIZE, torch.device("cpu"))
    assert builder.build([None, None]) is None  # an unconstrained batch: no mask at all
    mask = builder.build([None, grammar.new_matcher(), None, finished])
    assert mask is not None and mask.rows.tolist() == [1, 3]
    logits = apply_grammar_mask(torch.zeros(4, VOCAB_SIZE), mask)
    allowed = torch.isfinite(logits)
    assert allowed[0].all() and allowed[2].all()  # free rows untouched
    allowed_ids = torch.nonzero(allowed[1]).view(-1).tolist()
    for word in ("alpha", "beta"):  # the canonical first tokens, and only prefixes
        assert smollm2_tokenizer.encode(word, add_special_tokens=False)[0] in allowed_ids
    texts = [smollm2_tokenizer.decode([t]) for t in allowed_ids]
    assert all(text and ("alpha".startswith(text) or "beta".startswith(text)) for text in texts)
    assert allowed[3].all()  # a terminated matcher's row: its result is dropped anyway
    again = builder.build([grammar.new_matcher()] * 9)  # the host buffer grows
    assert again is not None and again.bits.shape == (9, (VOCAB_SIZE + 31) // 32)
