"""What the deploy tests share: every kustomization under deploy/k8s rendered, and lookups into
the rendered objects."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import yaml

from tests.unit.deploy.dockerfile import REPO_ROOT
from tests.unit.deploy.kustomize_lite import render

K8S = REPO_ROOT / "deploy" / "k8s"
ROLE_COMMANDS = ("pd-router", "pd-prefill", "pd-decode")
# what the downward API gives a pod (env valueFrom.fieldRef), for expanding $(VAR) in args
FIELD_VALUES = {"status.podIP": "10.1.2.3", "metadata.name": "pod-0", "metadata.namespace": "ns"}


def kustomizations() -> dict[str, Path]:
    """Name (relative folder) -> folder of every Kustomization under deploy/k8s."""
    found = {}
    for path in sorted(K8S.rglob("kustomization.yaml")):
        if yaml.safe_load(path.read_text()).get("kind", "Kustomization") == "Kustomization":
            found[path.parent.relative_to(K8S).as_posix()] = path.parent
    return found


@functools.cache
def rendered(name: str) -> tuple[dict[str, Any], ...]:
    return tuple(render(kustomizations()[name]))


def find(objects, kind: str, name: str) -> dict[str, Any]:
    (match,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return match


def pod_templates(objects):
    """(workload, its pod template) for every Deployment/StatefulSet/DaemonSet."""
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
            yield obj, obj["spec"]["template"]


def pdserve_containers(objects):
    """(workload, pod template, container) for every container running a pdserve launcher."""
    for workload, template in pod_templates(objects):
        for container in template["spec"]["containers"]:
            if container.get("command", [""])[0] in ROLE_COMMANDS:
                yield workload, template, container


def container_env(objects, container: dict[str, Any]) -> dict[str, str]:
    """The environment Kubernetes gives `container` (envFrom ConfigMaps, then env)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        config_map = find(objects, "ConfigMap", source["configMapRef"]["name"])
        env.update(config_map.get("data", {}))
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            env[var["name"]] = FIELD_VALUES[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command and args ($$ escapes; unknown stays as is)."""

    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", replace, text)


def port_number(container: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port (a number, or the name of one of the container's ports)."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    return number
