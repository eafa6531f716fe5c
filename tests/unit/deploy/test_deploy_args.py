"""Every pdserve container in deploy/k8s starts with arguments its real launcher accepts:
$(VAR)s expanded as Kubernetes does (ConfigMaps, the downward API), parsed by the parsers of
pd-router, pd-prefill and pd-decode, turned into their config dataclasses (whose checks run),
and consistent with the manifests (the ports listened on are the ports declared and probed;
Prometheus scrapes the port each process serves /metrics on: the router's HTTP port, the nodes'
--metrics-port; the registry URL is the Redis Service; nodes advertise their pod IP)."""

from __future__ import annotations

import argparse
import contextlib
import io
from urllib.parse import urlsplit

import pytest

from decode_node.decode_server import DecodeServer
from node_common.launcher import build_node_parser
from pdserve.cli import engine_config, node_config, router_config
from prefill_node.prefill_server import PrefillServer
from router.cli import build_router_parser
from tests.unit.deploy.manifests import (
    FIELD_VALUES,
    container_env,
    expand,
    find,
    kustomizations,
    pdserve_containers,
    rendered,
)

PARSERS = {
    "pd-router": build_router_parser,
    "pd-prefill": lambda: build_node_parser(PrefillServer),
    "pd-decode": lambda: build_node_parser(DecodeServer),
}


def _parse(parser: argparse.ArgumentParser, argv: list[str], what: str) -> argparse.Namespace:
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{what}: its launcher rejects {argv}:\n{errors.getvalue()}")


def _containers_with_args(name: str):
    """(workload name, pod template, container, expanded argv) of every pdserve container."""
    objects = rendered(name)
    for workload, template, container in pdserve_containers(objects):
        env = container_env(objects, container)
        argv = [expand(arg, env) for arg in container.get("args", [])]
        unresolved = [arg for arg in argv if "$(" in arg]
        assert not unresolved, f"{workload['metadata']['name']}: unset variables {unresolved}"
        yield workload["metadata"]["name"], template, container, argv


def _check_config(command: str, args: argparse.Namespace, what: str) -> None:
    try:
        if command == "pd-router":
            assert args.decode or args.registry, f"{what}: pd-router needs --decode or --registry"
            router_config(args, prefill_addrs=tuple(args.prefill), decode_addrs=tuple(args.decode))
        else:
            node_config(args)
            engine_config(args)
    except ValueError as error:
        pytest.fail(f"{what}: its launcher would refuse the settings: {error}")


def _check_ports(
    name: str, template: dict, container: dict, args: argparse.Namespace, what: str
) -> None:
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert args.port == ports["grpc"], f"{what}: listens on {args.port}, declares {ports}"
    assert args.host == "0.0.0.0", f"{what}: must listen on every interface of the pod"
    if container["command"][0] == "pd-router":
        assert args.http_port == ports["http"], (
            f"{what}: HTTP on {args.http_port}, declares {ports}"
        )
        metrics_port = args.http_port  # /metrics is on the router's HTTP port
    else:
        assert args.kv_port == ports["kv"], f"{what}: KV port {args.kv_port} is not declared"
        assert args.advertise_host == FIELD_VALUES["status.podIP"], f"{what}: advertise the pod IP"
        assert args.metrics_port == ports["metrics"], f"{what}: /metrics on {args.metrics_port}"
        metrics_port = args.metrics_port
    annotations = template["metadata"]["annotations"]
    assert metrics_port, f"{what}: serves no /metrics, but its pods are scraped"
    assert int(annotations["prometheus.io/port"]) == metrics_port, f"{what}: scrapes another port"
    assert annotations["prometheus.io/path"] == "/metrics"
    registry = urlsplit(args.registry)
    redis = find(rendered(name), "Service", registry.hostname)
    assert registry.port in [p["port"] for p in redis["spec"]["ports"]], f"{what}: {registry}"


@pytest.mark.parametrize("name", list(kustomizations()))
def test_every_container_starts_with_arguments_its_launcher_accepts(name: str) -> None:
    for workload, template, container, argv in _containers_with_args(name):
        what = f"{name}: {workload}"
        command = container["command"][0]
        args = _parse(PARSERS[command](), argv, what)
        _check_config(command, args, what)
        _check_ports(name, template, container, args, what)


def test_a_bad_argument_fails_this_check() -> None:
    """The parsers really reject: an unknown flag and a bad choice."""
    parser = PARSERS["pd-decode"]()
    with pytest.raises(pytest.fail.Exception, match="rejects"):
        _parse(parser, ["--no-such-flag"], "decode")
    with pytest.raises(pytest.fail.Exception, match="invalid choice"):
        _parse(parser, ["--kv-transport", "carrier-pigeon"], "decode")
