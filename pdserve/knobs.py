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
