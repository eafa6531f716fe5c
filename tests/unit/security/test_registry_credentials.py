"""Issue 15: the registry's Redis ACL credentials and TLS (rediss://) reach redis-py from the
registry URL, against a real redis-server: an ACL user, `requirepass`, and mutual TLS; a client
without them is refused; logs never show the password."""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import urlencode

import pytest
import redis

from pdserve.config import RegistryConfig
from pdserve.registry import registry_client
from tests.redis_server import RedisServer
from tests.unit.security.tls_certs import issue, make_ca

pytestmark = pytest.mark.timeout(60)

USER, PASSWORD = "pdserve", "s3cret-pw"


async def _ping_and_write(url: str) -> bool:
    client = registry_client(RegistryConfig(url=url))
    try:
        async with asyncio.timeout(5):
            await client.set("pdserve:probe", b"1")
            return await client.get("pdserve:probe") == b"1"
    finally:
        await client.aclose()


def _refused(url: str) -> type[Exception]:
    try:
        asyncio.run(_ping_and_write(url))
    except (redis.RedisError, OSError) as error:
        return type(error)
    raise AssertionError(f"{RegistryConfig(url=url).redacted_url} was let in")


def test_an_acl_user_in_the_url_authenticates(tmp_path: Path) -> None:
    acl = ("--user", "default", "off", "--user", USER, "on", f">{PASSWORD}", "~*", "&*", "+@all")
    server = RedisServer(
        tmp_path, args=acl, client_kwargs={"username": USER, "password": PASSWORD}
    ).start()
    try:
        good = f"redis://{USER}:{PASSWORD}@127.0.0.1:{server.port}/0"
        assert asyncio.run(_ping_and_write(good))
        assert issubclass(_refused(f"redis://127.0.0.1:{server.port}/0"), redis.RedisError)
        wrong = f"redis://{USER}:wrong@127.0.0.1:{server.port}/0"
        assert issubclass(_refused(wrong), redis.AuthenticationError)
        assert RegistryConfig(url=good).redacted_url == (
            f"redis://{USER}:***@127.0.0.1:{server.port}/0"
        )
    finally:
        server.kill()


def test_requirepass_in_the_url_authenticates(tmp_path: Path) -> None:
    server = RedisServer(
        tmp_path, args=("--requirepass", PASSWORD), client_kwargs={"password": PASSWORD}
    ).start()
    try:
        assert asyncio.run(_ping_and_write(f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"))
        assert issubclass(_refused(f"redis://127.0.0.1:{server.port}/0"), redis.RedisError)
    finally:
        server.kill()


def test_rediss_with_client_certificates_and_an_acl_user(tmp_path: Path) -> None:
    ca = make_ca(tmp_path, "redis-ca")
    server_files = issue(tmp_path, "redis-server", ca, "redis-ca")
    client_files = issue(tmp_path, "registry-client", ca, "redis-ca")
    port = RedisServer(tmp_path).port
    tls = (
        "--port", "0", "--tls-port", str(port), "--tls-cert-file", server_files.cert,
        "--tls-key-file", server_files.key, "--tls-ca-cert-file", server_files.ca,
        "--tls-auth-clients", "yes",
        "--user", "default", "off", "--user", USER, "on", f">{PASSWORD}", "~*", "&*", "+@all",
    )  # fmt: skip
    probe = {
        "host": "127.0.0.1", "ssl": True, "ssl_ca_certs": client_files.ca,
        "ssl_certfile": client_files.cert, "ssl_keyfile": client_files.key,
        "username": USER, "password": PASSWORD,
    }  # fmt: skip
    server = RedisServer(tmp_path, port=port, args=tls, client_kwargs=probe).start()
    try:
        files = {"ssl_ca_certs": client_files.ca, "ssl_certfile": client_files.cert,
                 "ssl_keyfile": client_files.key}  # fmt: skip
        base = f"rediss://{USER}:{PASSWORD}@127.0.0.1:{port}/0"
        assert asyncio.run(_ping_and_write(f"{base}?{urlencode(files)}"))
        no_client_cert = urlencode({"ssl_ca_certs": client_files.ca})
        assert issubclass(_refused(f"{base}?{no_client_cert}"), (redis.RedisError, OSError))
        plain = f"redis://{USER}:{PASSWORD}@127.0.0.1:{port}/0"
        assert issubclass(_refused(plain), (redis.RedisError, OSError))
    finally:
        server.kill()
