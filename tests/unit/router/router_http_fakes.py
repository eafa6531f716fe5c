"""What the HTTP API tests share: a RouterHarness serving HTTP on a free port, its /v1 URL."""

from __future__ import annotations

from router_fakes import RouterHarness

from pdserve.v1 import node_pb2

TEXT = "one two three four five six seven eight"  # what the fake nodes generate


def harness(
    tokenizer_files: node_pb2.TokenizerFiles, output_ids: list[int], **config: object
) -> RouterHarness:
    return RouterHarness(tokenizer_files, output_ids, free_http_port=True, **config)


def base_url(h: RouterHarness) -> str:
    return f"{h.router.http.url}/v1"
