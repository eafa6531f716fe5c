"""The error a request's sender can fix: every check of the request vocabulary raises it."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request or its parameters cannot be served; the message says what to fix, `param`
    (when one is to blame) names the parameter (OpenAI's error "param")."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
