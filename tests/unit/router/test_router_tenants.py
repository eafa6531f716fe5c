"""Issue 39 item 3, the router's side: each API key is a tenant whose requests reach both nodes
with a cache salt of their own (the same over gRPC and HTTP, never the key), a client's
cache_salt narrows it, and --share-prefix-cache-across-tenants lets tenants share."""

from __future__ import annotations

import httpx
import pytest
from router_fakes import run
from router_http_fakes import TEXT, base_url, harness

from router.client import GenerationClient

KEYS = ["key-of-tenant-a-0123456789", "key-of-tenant-b-0123456789"]


@pytest.fixture(scope="module")
def output_ids(tokenizer) -> list[int]:
    return tokenizer.encode(TEXT, add_special_tokens=False)


def _salts(tokenizer_files, output_ids, tmp_path, **config) -> list[tuple[str, str]]:
    """(prefill's, decode's) cache salt of: key A over gRPC, key A over HTTP, key B over gRPC,
    key A with a client cache_salt over HTTP."""
    keys = tmp_path / "keys"
    keys.write_text("\n".join(KEYS) + "\n")

    async def body():
        async with harness(tokenizer_files, output_ids, api_key_file=str(keys), **config) as h:
            for key in (KEYS[0], None, KEYS[1]):
                if key is None:
                    await _http(h, KEYS[0], {})
                    continue
                async with GenerationClient(h.router.address, api_key=key) as client:
                    await client.generate_all("hello", max_tokens=2)
            await _http(h, KEYS[0], {"cache_salt": "mine"})
            prefill = [r.cache_salt for r in h.prefill[0].requests]
            decode = [r.cache_salt for r in h.decode[0].requests]
            return list(zip(prefill, decode, strict=True))

    return run(body())


async def _http(h, key: str, extra: dict) -> None:
    async with httpx.AsyncClient(base_url=base_url(h), timeout=30) as http:
        response = await http.post(
            "/completions",
            headers={"authorization": f"Bearer {key}"},
            json={"model": "fake-model", "prompt": "hello", "max_tokens": 2, **extra},
        )
    assert response.status_code == 200, response.text


def test_each_api_key_is_a_tenant_of_its_own(tokenizer_files, output_ids, tmp_path):
    a_grpc, a_http, b_grpc, a_mine = _salts(tokenizer_files, output_ids, tmp_path)
    for prefill, decode in (a_grpc, a_http, b_grpc, a_mine):
        assert prefill == decode and len(prefill) == 64  # both legs alike: a digest
        assert not any(key in prefill for key in KEYS)
    assert a_grpc == a_http  # one tenant, whichever API
    assert len({a_grpc, b_grpc, a_mine}) == 3


def test_tenants_may_be_let_share(tokenizer_files, output_ids, tmp_path):
    a_grpc, a_http, b_grpc, a_mine = _salts(
        tokenizer_files, output_ids, tmp_path, share_prefix_cache_across_tenants=True
    )
    assert a_grpc == a_http == b_grpc == ("", "")
    assert a_mine[0] == a_mine[1] != ""  # a client's cache_salt still separates


def test_a_client_salt_must_be_text_of_reasonable_length(tokenizer_files, output_ids):
    async def body():
        async with harness(tokenizer_files, output_ids) as h:
            async with httpx.AsyncClient(base_url=base_url(h), timeout=30) as http:
                answers = [
                    await http.post(
                        "/completions",
                        json={"model": "fake-model", "prompt": "x", "cache_salt": salt},
                    )  # fmt: skip
                    for salt in ("", 7, "x" * 1025)
                ]
            return answers

    for response in run(body()):
        assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt"
