"""Text <-> token ids for one model, and its chat template. Torch-free (the router uses it too).

Reads a Hugging Face tokenizer folder: tokenizer.json (through `tokenizers`),
tokenizer_config.json (bos/eos tokens, add_bos_token, chat_template as a string or a list of
named templates), chat_template.jinja when the config has no template, and the eos ids of
generation_config.json when present.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pdserve.chat_tools import hermes_messages, uses_tools
from pdserve.sampling_params import InvalidRequestError

CHAT_ROLES = ("system", "user", "assistant", "tool")
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # a byte-fallback token (SentencePiece)


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): each byte is written as one printable character;
    printable Latin-1 bytes as themselves, the others as chr(256 + k) in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    chars = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    chars.update({chr(256 + k): b for k, b in enumerate(others)})
    return chars


_BYTE_LEVEL_CHARS = _byte_level_chars()


def _token_content(value: str | dict[str, Any] | None) -> str | None:
    """A special token entry of tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _select_chat_template(template: str | list[dict[str, str]] | None, folder: Path) -> str | None:
    """The config's template (a string, or the one named "default" in a list of named
    templates), else chat_template.jinja beside it."""
    if isinstance(template, list):
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return template


class Tokenizer:
    """Encode, decode and chat-format text for one model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_tokens: tuple[str, ...] = (),
        extra_eos_token_ids: tuple[int, ...] = (),
        add_bos_token: bool = False,
        chat_template: str | None = None,
        name: str = "tokenizer",
    ) -> None:
        self._backend = backend
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        eos_ids = [backend.token_to_id(t) for t in eos_tokens] + list(extra_eos_token_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(i for i in eos_ids if i is not None)
        )
        self.add_bos_token = add_bos_token and self.bos_token_id is not None
        self.chat_template = chat_template

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {folder}; point at a Hugging Face model folder"
            )
        config = _read_json(folder / "tokenizer_config.json")
        generation_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        if isinstance(generation_eos, int):
            generation_eos = [generation_eos]
        eos_token = _token_content(config.get("eos_token"))
        return cls(
            tokenizers.Tokenizer.from_file(str(tokenizer_file)),
            bos_token=_token_content(config.get("bos_token")),
            eos_tokens=(eos_token,) if eos_token else (),
            extra_eos_token_ids=tuple(generation_eos or ()),
            add_bos_token=bool(config.get("add_bos_token", False)),
            chat_template=_select_chat_template(config.get("chat_template"), folder),
            name=str(folder),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's vocab may be padded larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id if self.add_bos_token else None
        if add_special_tokens and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for, also when they are only part of a UTF-8 character
        (its decoded text then shows U+FFFD): byte-level BPE's characters mapped back to bytes,
        a byte-fallback token <0xAB> its byte, any other token its text."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        byte_level = isinstance(self._backend.decoder, tokenizers.decoders.ByteLevel)
        if byte_level and all(c in _BYTE_LEVEL_CHARS for c in piece):
            return bytes(_BYTE_LEVEL_CHARS[c] for c in piece)
        if match := _BYTE_TOKEN.match(piece):
            return bytes([int(match.group(1), 16)])
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render a conversation into the model's prompt text. `tools` (OpenAI's / transformers'
        shape, pdserve.chat_tools) go to a template that reads them; for one that does not, the
        tools, tool calls and tool results are rendered Hermes-style (`hermes_messages`)."""
        _validate_messages(messages)
        template = self._compiled_chat_template
        if uses_tools(messages, tools) and not self.template_takes_tools:
            messages, tools = hermes_messages(messages, tools), None
        try:
            return template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:  # e.g. raise_exception("roles must alternate")
            raise InvalidRequestError(
                f"chat template rejected the messages: {exc}", "messages"
            ) from exc

    @cached_property
    def template_takes_tools(self) -> bool:
        """Whether the chat template reads a `tools` variable (Qwen2.5's, Llama 3.1's do)."""
        if not self.chat_template:
            return False
        try:
            parsed = _chat_environment().parse(self.chat_template)
        except jinja2.TemplateSyntaxError:
            return False  # (rendering says so)
        return "tools" in jinja2.meta.find_undeclared_variables(parsed)

    @cached_property
    def _compiled_chat_template(self) -> jinja2.Template:
        if not self.chat_template:
            raise InvalidRequestError(
                f"the model's tokenizer ({self.name}) has no chat template; send a plain "
                "prompt instead of messages"
            )
        try:
            return _chat_environment().from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template of {self.name} does not parse: {exc}") from exc


def _validate_messages(messages: list[dict[str, Any]]) -> None:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(
            "messages must be a non-empty list of {role, content} dicts", "messages"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(
                f"messages[{i}] must be a dict with role and content", "messages"
            )
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"messages[{i}] has role {role!r}; allowed roles: {', '.join(CHAT_ROLES)}",
                "messages",
            )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _chat_environment() -> ImmutableSandboxedEnvironment:
    """The sandboxed jinja2 environment Hugging Face renders chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
