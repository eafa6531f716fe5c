"""Host and address helpers every process shares (torch-free).

bracket("::1") -> "[::1]"                 an IPv6 host as it appears in HOST:PORT
host_port("::1", 80) -> "[::1]:80"
dial_host("0.0.0.0") -> this machine's address (peers cannot dial a wildcard)
redact_url(url)      "redis://user:pw@host/0" -> "redis://user:***@host/0" (for logs)
"""

from __future__ import annotations

import socket

WILDCARD_HOSTS = ("0.0.0.0", "::", "*", "")


def bracket(host: str) -> str:
    """`host` ready to be followed by ":PORT" (IPv6 literals in brackets, once)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def host_port(host: str, port: int | str) -> str:
    """ "HOST:PORT", with an IPv6 host in brackets."""
    return f"{bracket(host)}:{port}"


def dial_host(host: str) -> str:
    """The host peers should dial to reach a listener bound to `host`: `host` itself, or this
    machine's address when `host` is a wildcard (0.0.0.0, ::, *)."""
    if host in WILDCARD_HOSTS:
        return socket.gethostbyname(socket.gethostname())
    return host


def redact_url(url: str) -> str:
    """`url` with its password (if any) replaced by ***."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, hostpart = rest.rpartition("@")
    if not sep or not at or ":" not in userinfo:
        return url
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{hostpart}"
