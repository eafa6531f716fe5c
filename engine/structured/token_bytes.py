"""llguidance's tokenizer, built so that its idea of each token's bytes is the model's.

A grammar mask is only as right as the bytes the grammar engine believes each token stands
for. llguidance reads a Hugging Face tokenizer.json itself and infers those bytes from its
decoder; a tokenizer.json whose decoder it misreads gives silently wrong masks. Seen: the
GGUF conversion of transformers 5.17 writes SmolLM2's decoder as a `Sequence` (ByteFallback,
Fuse, Replace, ByteLevel) and llguidance then took token 198 ("Ċ", the byte-level "\\n") for
the two bytes C4 8A, so a JSON string admitted a raw newline (transformers 5.24 writes a plain
`ByteLevel` decoder, read right).

So: build from tokenizer.json, then check the decoding against the `tokenizers` library's (the
one that makes the served text) on probe texts. On a mismatch, rebuild from the token bytes
this module derives from the vocabulary (byte-level tokens through GPT-2's byte <-> unicode
table; `<0xNN>` byte-fallback tokens; sentencepiece's "▁" as a space) and check again; a
tokenizer still misread is refused with an error, never served with wrong masks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from functools import cache

import llguidance
import tokenizers

logger = logging.getLogger(__name__)

# Whitespace, escapes, quotes, punctuation and multi-byte UTF-8: where decoders differ.
PROBE_TEXTS = (
    '{"a": [1, 2.5e-3, true, null], "b": "x\\ny"}\n\t  indented line\r\n',
    "Grüße, naïve café — 東京 🙂 <tag attr='v'>",
)


def build_ll_tokenizer(
    tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for `tokenizer_json`, its decoding checked (ValueError if no
    construction decodes the probe texts as the `tokenizers` library does)."""
    hf = tokenizers.Tokenizer.from_str(tokenizer_json)
    eos = list(eos_token_ids)
    built = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
    misread = decoding_misfit(built, hf)
    if misread is None:
        return built
    logger.info(
        "llguidance misreads this tokenizer.json's decoder (%s): using token bytes", misread
    )
    wrapper = llguidance.TokenizerWrapper(_VocabBytes(hf, vocab_size, eos[0]))
    rebuilt = llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)
    still = decoding_misfit(rebuilt, hf)
    if still is not None:
        raise ValueError(
            f"structured outputs cannot run with this tokenizer: the grammar engine decodes its "
            f"tokens differently from the tokenizer ({still})"
        )
    return rebuilt


def decoding_misfit(ll: llguidance.LLTokenizer, hf: tokenizers.Tokenizer) -> str | None:
    """Where `ll` decodes a probe text's token ids differently from `hf`; None if nowhere."""
    for text in PROBE_TEXTS:
        ids = hf.encode(text, add_special_tokens=False).ids
        want = hf.decode(ids, skip_special_tokens=False).encode("utf-8")
        got = ll.decode_bytes(ids)
        if got != want:
            return f"{want[:40]!r} decoded as {got[:40]!r}"
    return None


class _VocabBytes:
    """What `llguidance.TokenizerWrapper` asks of a tokenizer: every token's bytes, the EOS
    and BOS ids, the special tokens, and encoding."""

    def __init__(self, hf: tokenizers.Tokenizer, vocab_size: int, eos_token_id: int) -> None:
        self._hf = hf
        specials = {t.content for t in hf.get_added_tokens_decoder().values() if t.special}
        to_bytes = _token_to_bytes(json.loads(hf.to_str()).get("pre_tokenizer"))
        self.tokens: list[bytes] = []
        self.special_token_ids: list[int] = []
        for token_id in range(vocab_size):
            piece = hf.id_to_token(token_id)
            if piece is None:
                self.tokens.append(b"")
            elif piece in specials:
                self.special_token_ids.append(token_id)
                self.tokens.append(piece.encode("utf-8"))
            else:
                self.tokens.append(to_bytes(piece))
        self.eos_token_id = eos_token_id
        self.bos_token_id = None

    def __call__(self, text: str) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=False).ids)


def _token_to_bytes(pre_tokenizer: dict | None) -> Callable[[str], bytes]:
    """Byte-level vocabularies (a ByteLevel pre-tokenizer, alone or in a sequence) spell bytes
    as GPT-2's unicode characters; others are sentencepiece-like."""
    return _byte_level_bytes if '"ByteLevel"' in json.dumps(pre_tokenizer or {}) else _sp_bytes


def _byte_level_bytes(piece: str) -> bytes:
    table = _unicode_to_byte()
    if all(ch in table for ch in piece):
        return bytes(table[ch] for ch in piece)
    return piece.encode("utf-8")  # an added (non-special) token spelled as itself


def _sp_bytes(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])  # byte fallback
    return piece.replace("\u2581", " ").encode("utf-8")


@cache
def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's table: printable bytes stand for themselves, the rest for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table
