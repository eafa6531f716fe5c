"""Logging for every launcher: the request id on each line about a request, text or JSON.

```
with request_context(request_id):     sets a contextvar for this task (and tasks it starts)
    logger.info("...")                 RequestIdFilter stamps record.request_id ("" outside)
configure_logging(level, role, fmt)    text: "TIME LEVEL [role] name: [req=ID] message"
                                       json: one object per line {ts, level, role, logger,
                                       request_id, msg[, exc]}
```

The id lives in a `contextvars.ContextVar`, so concurrent requests on one event loop each log
their own; asyncio tasks copy the context when they are created.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
from collections.abc import Iterator

LOG_FORMATS = ("text", "json")

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("pdserve_request_id", default="")


def current_request_id() -> str:
    """The id of the request this code runs for ("" outside any)."""
    return _request_id.get()


@contextlib.contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Log lines inside carry `request_id` (restored on exit)."""
    token = _request_id.set(request_id)
    try:
        yield
    finally:
        _request_id.reset(token)


def set_request_id(request_id: str) -> None:
    """For a handler task that serves one request to its end: its lines carry the id."""
    _request_id.set(request_id)


class RequestIdFilter(logging.Filter):
    """Stamps `record.request_id` (and `record.request_tag`, "[req=ID] " or "")."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = getattr(record, "request_id", None) or _request_id.get()
        record.request_id = request_id
        record.request_tag = f"[req={request_id}] " if request_id else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line."""

    def __init__(self, role: str) -> None:
        super().__init__()
        self._role = role

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "role": self._role,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "") or None,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, role: str, fmt: str = "text") -> None:
    """The root logger of a launcher: `level`, the request-id filter, `fmt` ("text" | "json")."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; expected one of {LOG_FORMATS}")
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter(role))
    else:
        handler.setFormatter(
            logging.Formatter(
                f"%(asctime)s %(levelname)s [{role}] %(name)s: %(request_tag)s%(message)s"
            )
        )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
