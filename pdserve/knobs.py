"""How a setting is declared: `knob(...)` is a dataclass field with its command-line flag
(help, flag name, parser, choices), read back by `pdserve.cli.add_config_flags`; plus the parsers
and knobs that several configs share. Torch-free."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from typing import Any


def parse_size(text: str) -> int:
    """'2GiB', '512MiB', '1G', '1073741824' -> bytes (ValueError when not a size)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    cleaned = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        if cleaned and cleaned[-1] in units:
            return int(float(cleaned[:-1]) * units[cleaned[-1]])
        return int(cleaned)
    except ValueError:
        raise ValueError(
            f"not a size: {text!r} (use bytes or a suffix, e.g. 512MiB, 2GiB)"
        ) from None


def knob(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    cli: bool = True,
) -> Any:
    """A config field with its command-line flag. `flag`: the flag's name when it is not
    `--field-name` (a bool that defaults to True gets `--no-...`); `parse`: how the flag's text
    becomes the value (default: the field's type); `cli=False`: no flag (set by code)."""
    metadata = {"help": help, "flag": flag, "parse": parse, "choices": choices, "cli": cli}
    return field(default=default, metadata=metadata)


def prefix_cache_salt_knob() -> Any:
    """The prefix cache's salt (pdserve.block_hash), one knob for the engine and the router."""
    return knob(
        None,
        "salt of the prefix cache's sha256 block hashes: deployments that must not share cached "
        "prefixes never do (default: PDSERVE_PREFIX_CACHE_SALT); the same on router and nodes",
    )


def transfer_timeout_knob() -> Any:
    """The one KV hand-off timeout: how long it may go without progress (router, prefill and
    decode alike; see router/README.md)."""
    return knob(
        30.0,
        "a KV hand-off fails after this long without progress (the prefill node reports it "
        "while it computes this prompt or those queued ahead of it), and the decode node "
        "prefills the prompt itself (prefill nodes cap the router's at theirs)",
    )


def ticket_timeout_knob() -> Any:
    """How long a decode node may take to reserve a hand-off's KV blocks (router and prefill
    alike; see router/README.md)."""
    return knob(
        30.0,
        "how long a decode node may take to reserve a hand-off's KV blocks (its reservation may "
        "queue for free blocks): the router waits this long for its ticket, and a prefill node, "
        "which starts the prompt before it, holds the computed KV this long for it (prefill "
        "nodes cap the router's at theirs)",
    )


def prefill_rate_knob() -> Any:
    """The slowest prefill that hand-offs and the router wait for (one knob, every role)."""
    return knob(
        20.0,
        "the slowest prefill, in prompt tokens per second, that KV hand-offs and the router's "
        "wait for a first token allow for: behind N prompt tokens (its own and those queued "
        "ahead of it on the prefill node) a hand-off that keeps making progress may take "
        "--transfer-timeout-s + N / this",
    )
