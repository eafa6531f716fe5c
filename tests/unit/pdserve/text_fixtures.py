"""Tokenizers for the tests of pdserve/tokenizer.py and pdserve/detokenizer.py: tiny ones trained
on the spot and saved as Hugging Face folders, and the default model's real one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "héllo wörld 日本語 🙂",
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there! naïve café, 日本 and 語 🙂🙃",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_byte_level_tokenizer(
    folder: Path, chat_template: str | list | None = CHATML_TEMPLATE, **config: object
) -> Path:
    """A byte-level BPE small enough that multi-byte characters split across tokens; writes
    tokenizer.json and tokenizer_config.json (ChatML template, eos <|im_end|>) to `folder`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 3, trainer)
    tokenizer_config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", **config}
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    return _save(folder, tokenizer, tokenizer_config)


def build_metaspace_tokenizer(folder: Path) -> Path:
    """A SentencePiece-style BPE ("▁" marks a space; decoding drops the first token's leading
    space), whose tokens decoded one by one lose their spacing."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tokenizer.train_from_iterator(CORPUS * 3, trainer)
    return _save(folder, tokenizer, {"bos_token": "<s>", "eos_token": "</s>"})


def default_model_tokenizer_dir() -> Path:
    """The default model's tokenizer folder (its GGUF converted once, then cached); skips the
    calling test when the model's package is not installed."""
    from engine.model.sources import resolve_model_source
    from pdserve.config import DEFAULT_MODEL

    try:
        source = resolve_model_source(DEFAULT_MODEL)
    except FileNotFoundError as exc:
        pytest.skip(f"default model {DEFAULT_MODEL} unavailable: {exc}")
    if source.tokenizer_dir is None:
        pytest.skip(f"default model {DEFAULT_MODEL} has no tokenizer.json")
    return source.tokenizer_dir


def _save(folder: Path, tokenizer: Tokenizer, tokenizer_config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    return folder
