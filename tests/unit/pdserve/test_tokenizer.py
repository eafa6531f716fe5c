import json
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers

from pdserve.sampling_params import InvalidRequestError
from pdserve.tokenizer import Tokenizer
from tests.unit.pdserve.text_fixtures import (
    CHATML_TEMPLATE,
    CORPUS,
    build_byte_level_tokenizer,
    default_model_tokenizer_dir,
)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "héllo 🙂"},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(build_byte_level_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.mark.parametrize("text", [*CORPUS, "", "  spaces  and\nnewlines\t", "unseen: ßπ€ 👍🏽"])
def test_encode_decode_round_trip(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids) == text


def test_multibyte_characters_split_across_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("日本語 🙂")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in pieces)  # what the detokenizer must handle
    assert tokenizer.decode(ids) == "日本語 🙂"


def test_special_tokens_and_vocab(tokenizer: Tokenizer) -> None:
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert tokenizer.eos_token_ids == (im_end,)
    assert tokenizer.id_to_token(im_end) == "<|im_end|>"
    assert tokenizer.vocab_size == 320
    assert tokenizer.token_to_id("no such token") is None
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == tokenizer.token_to_id("<|im_start|>") and ids[-1] == im_end
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_add_bos_token_and_generation_config_eos(tmp_path: Path) -> None:
    folder = build_byte_level_tokenizer(tmp_path, add_bos_token=True)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tokenizer = Tokenizer.from_dir(folder)
    bos = tokenizer.token_to_id("<|endoftext|>")
    assert tokenizer.encode("hello")[0] == bos
    assert tokenizer.encode("hello", add_special_tokens=False)[0] != bos
    assert tokenizer.decode(tokenizer.encode("hello")) == "hello"
    assert tokenizer.eos_token_ids == (tokenizer.token_to_id("<|im_end|>"), 0)


def test_chat_template_renders_chatml(tokenizer: Tokenizer) -> None:
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhéllo 🙂<|im_end|>\n"
    assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False) == expected
    rendered = tokenizer.apply_chat_template(MESSAGES)
    assert rendered == expected + "<|im_start|>assistant\n"


def test_named_templates_use_default(tmp_path: Path) -> None:
    templates = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": CHATML_TEMPLATE},
    ]
    tokenizer = Tokenizer.from_dir(build_byte_level_tokenizer(tmp_path, chat_template=templates))
    assert tokenizer.apply_chat_template(MESSAGES).startswith("<|im_start|>system\n")


def test_chat_template_jinja_file(tmp_path: Path) -> None:
    folder = build_byte_level_tokenizer(tmp_path, chat_template=None)
    (folder / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[-1]['content'] }}")
    assert Tokenizer.from_dir(folder).apply_chat_template(MESSAGES) == "<|endoftext|>héllo 🙂"


def test_template_helpers(tmp_path: Path) -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|{{ eos_token }}"
    )
    tokenizer = Tokenizer.from_dir(build_byte_level_tokenizer(tmp_path, chat_template=template))
    user_message = [{"role": "user", "content": "日本"}]
    assert tokenizer.apply_chat_template(user_message) == (
        '[{"role": "user", "content": "日本"}]|4|<|im_end|>'
    )
    with pytest.raises(InvalidRequestError, match="user first"):
        tokenizer.apply_chat_template(MESSAGES)


def test_template_cannot_escape_sandbox(tmp_path: Path) -> None:
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tokenizer = Tokenizer.from_dir(build_byte_level_tokenizer(tmp_path, chat_template=template))
    with pytest.raises(InvalidRequestError, match="unsafe"):
        tokenizer.apply_chat_template(MESSAGES)


def test_unknown_role_names_allowed_roles(tokenizer: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="'wizard'.*system, user, assistant, tool"):
        tokenizer.apply_chat_template([{"role": "wizard", "content": "hi"}])
    with pytest.raises(InvalidRequestError, match="non-empty list"):
        tokenizer.apply_chat_template([])


def test_missing_chat_template(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(build_byte_level_tokenizer(tmp_path, chat_template=None))
    with pytest.raises(InvalidRequestError, match="has no chat template"):
        tokenizer.apply_chat_template(MESSAGES)


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_text_modules_do_not_import_torch() -> None:
    code = "import sys, pdserve.tokenizer, pdserve.detokenizer; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


@pytest.mark.slow
def test_default_model_tokenizer_matches_transformers() -> None:
    from transformers import AutoTokenizer

    folder = default_model_tokenizer_dir()
    tokenizer, reference = Tokenizer.from_dir(folder), AutoTokenizer.from_pretrained(folder)
    for text in [*CORPUS, "  x\n\ny", "<|im_start|>user\nhi<|im_end|>"]:
        assert tokenizer.encode(text) == reference.encode(text)
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text
    assert tokenizer.token_to_id("<|im_end|>") in tokenizer.eos_token_ids
    for add_generation_prompt in (True, False):
        assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt) == (
            reference.apply_chat_template(
                MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )


def test_token_bytes_are_the_tokens_own_bytes(tokenizer: Tokenizer) -> None:
    """Byte-level BPE: a token holding part of a character has its bytes, not U+FFFD's."""
    text = "日本語 🙂 <|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces) == text.encode()
    assert any(b"\xef\xbf\xbd" not in p and "\ufffd" in tokenizer.decode([i])
               for i, p in zip(ids, pieces, strict=True))  # fmt: skip


def test_token_bytes_of_byte_fallback_tokens() -> None:
    byte_tokens = {f"<0x{b:02X}>": b for b in range(256)}
    model = tokenizers.models.BPE(vocab={"<unk>": 256, **byte_tokens, "a": 257}, merges=[],
                                  unk_token="<unk>", byte_fallback=True)  # fmt: skip
    backend = tokenizers.Tokenizer(model)
    backend.decoder = tokenizers.decoders.Sequence(
        [tokenizers.decoders.ByteFallback(), tokenizers.decoders.Fuse()]
    )
    tokenizer = Tokenizer(backend)
    ids = tokenizer.encode("a日", add_special_tokens=False)
    assert [tokenizer.token_bytes(i) for i in ids] == [b"a", b"\xe6", b"\x97", b"\xa5"]
