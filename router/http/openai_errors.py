"""OpenAIError: an HTTP error in OpenAI's JSON shape, and the router's errors mapped to it.

{"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": null}}
"""

from __future__ import annotations

from typing import Any

import grpc

from router.errors import RouterError

# gRPC status -> (HTTP status, OpenAI error type)
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


class OpenAIError(Exception):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        error_type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.error_type = error_type
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    @classmethod
    def from_router_error(cls, error: RouterError) -> OpenAIError:
        status, error_type = _HTTP_STATUS.get(error.code, (500, "internal_error"))
        return cls(error.message, status=status, error_type=error_type, code=error.code.name)
