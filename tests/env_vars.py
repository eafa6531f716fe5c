"""A check for pdserve/envs.py's readers, shared by the tests of each variable."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def assert_env_reads(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    value: str | None,
    want: Any,
    read: Callable[[], Any],
) -> None:
    """With `name` set to `value` (None: unset), `read()` returns `want`; want None: it raises
    a ValueError that names the variable."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    if want is None:
        with pytest.raises(ValueError, match=name):
            read()
    else:
        assert read() == want and type(read()) is type(want)
