"""RequestRecord: one request's route, token counts and timings, for metrics and its access
log line (written once, when the request ends).

A traced request (the client asked: `pdserve-trace` metadata) also carries its milestones
(`Marks`, time.monotonic() by name, each set once by `mark`): "received", "processed"
(validated, tokenized), "routed" (the policy picked), "decode_sent" / "prefill_sent" (the node
calls started), "ticket" (D's ticket in), "attached" (P took it), "prefill_first_token" /
"decode_first_token" (the first token in from P / D), "first_token_out" (to the client). They
go back to the client in the trailing metadata and into the access line (`spans=`). An
untraced request records none: `mark` is one `is None` test.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

Marks = dict[str, float] | None  # a traced request's milestones by name; None: not traced
# Request metadata asking for the request's milestones; the trailing metadata of the same name
# carries them (JSON: name -> time.monotonic() of the router's host).
TRACE_METADATA = "pdserve-trace"


def mark(marks: Marks, name: str) -> None:
    """Records milestone `name` of a traced request (its first time only)."""
    if marks is not None and name not in marks:
        marks[name] = time.monotonic()


@dataclass
class RequestRecord:
    request_id: str
    api: str  # "grpc" | "http"
    start_s: float = field(default_factory=time.monotonic)
    route: str = "-"  # "P=addr D=addr" or "local(reason) D=addr" (the last attempt's)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    end_s: float | None = None
    finish_reason: str = ""  # "stop" | "length" | "abort" when served
    status: str = "OK"  # gRPC status name: OK, INVALID_ARGUMENT, CANCELLED, UNAVAILABLE, ...
    marks: Marks = None  # traced: its milestones

    def tokens_sent(self, num_tokens: int, now_s: float) -> None:
        if num_tokens and self.first_token_s is None:
            self.first_token_s = now_s
            if self.marks is not None:
                self.marks["first_token_out"] = now_s
        if num_tokens:
            self.last_token_s = now_s
        self.completion_tokens += num_tokens

    def end(self, status: str = "OK", finish_reason: str = "") -> None:
        self.status = status
        self.finish_reason = finish_reason
        self.end_s = time.monotonic()

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def total_s(self) -> float:
        return (self.end_s or time.monotonic()) - self.start_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (0 with fewer than two tokens)."""
        if self.completion_tokens < 2 or self.first_token_s is None:
            return 0.0
        last = self.last_token_s or self.first_token_s
        return (last - self.first_token_s) / (self.completion_tokens - 1)

    def access_line(self) -> str:
        ttft = "-" if self.ttft_s is None else f"{self.ttft_s * 1000:.1f}ms"
        outcome = self.finish_reason if self.status == "OK" else self.status
        line = (
            f"request {self.request_id} {self.api} route={self.route} "
            f"prompt_tokens={self.prompt_tokens} completion_tokens={self.completion_tokens} "
            f"cached_tokens={self.cached_tokens} ttft={ttft} total={self.total_s * 1000:.1f}ms "
            f"status={self.status} finish={outcome or '-'}"
        )
        if self.marks:
            line += " spans=" + self.spans()
        return line

    def spans(self) -> str:
        """A traced request's milestones in time order, ms after it arrived: "name:ms,..."."""
        marks = self.marks or {}
        start_s = marks.get("received", self.start_s)
        ordered = sorted(marks.items(), key=lambda item: item[1])
        return ",".join(f"{name}:{(t - start_s) * 1e3:.3f}" for name, t in ordered)
