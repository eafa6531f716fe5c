"""deploy/k8s, checked offline: every kustomization renders (tests/unit/deploy/kustomize_lite,
compared with `kubectl kustomize` when one is installed), every object validates against the
Kubernetes schemas (kubernetes-validate, strict: unknown fields fail), and the pieces fit:
Services reach pods, probes and scrape annotations name ports that exist, node roles scale on
their own, the GPU overlay asks for GPUs."""

from __future__ import annotations

import shutil
import subprocess

import kubernetes_validate
import pytest
import yaml

from tests.unit.deploy import dockerfile
from tests.unit.deploy.manifests import (
    find,
    kustomizations,
    pdserve_containers,
    pod_templates,
    port_number,
    rendered,
)

# The oldest Kubernetes with GA gRPC probes that kubernetes-validate ships schemas for, and the
# newest it ships.
K8S_VERSIONS = ("1.27.0", "1.37.0")
RENDERINGS = list(kustomizations())
NODE_ROLES = ("prefill", "decode")


def test_every_overlay_is_found() -> None:
    assert {"base", "overlays/gpu", "overlays/dev"} <= set(kustomizations())


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", RENDERINGS)
def test_objects_validate_against_kubernetes_schemas(name: str, version: str) -> None:
    problems = []
    for obj in rendered(name):
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            where = "/".join(str(p) for p in error.absolute_path)
            problems.append(f"{obj['kind']}/{obj['metadata']['name']} at {where}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            problems.append(error.message)
    assert not problems, "\n".join(problems)


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.mark.skipif(_kustomize_command() is None, reason="no kustomize or kubectl installed")
@pytest.mark.parametrize("name", RENDERINGS)
def test_renderer_agrees_with_kustomize(name: str) -> None:
    folder = kustomizations()[name]
    result = subprocess.run(
        [*_kustomize_command(), str(folder)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    theirs = [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    def by_name(objects):
        return {(o["kind"], o["metadata"]["name"]): o for o in objects}

    assert by_name(rendered(name)) == by_name(theirs)


@pytest.mark.parametrize("name", RENDERINGS)
def test_services_select_pods_and_name_their_ports(name: str) -> None:
    objects = rendered(name)
    for service in (o for o in objects if o["kind"] == "Service"):
        selector = service["spec"]["selector"]
        templates = [
            t for _, t in pod_templates(objects)
            if selector.items() <= t["metadata"]["labels"].items()
        ]  # fmt: skip
        assert templates, f"Service {service['metadata']['name']} selects no pod template"
        for template in templates:
            (container,) = template["spec"]["containers"]
            for port in service["spec"]["ports"]:
                port_number(container, port.get("targetPort", port["port"]))


@pytest.mark.parametrize("name", RENDERINGS)
def test_probes_and_scrape_annotations_name_real_ports(name: str) -> None:
    for workload, template, container in pdserve_containers(rendered(name)):
        what = workload["metadata"]["name"]
        ports = {p["containerPort"] for p in container["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in container, f"{what} has no {probe}"
            (kind,) = set(container[probe]) & {"grpc", "tcpSocket", "httpGet", "exec"}
            assert port_number(container, container[probe][kind]["port"]) in ports
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) in ports, f"{what} scrapes a closed port"


@pytest.mark.parametrize("name", RENDERINGS)
def test_nodes_get_time_to_load_and_shared_memory(name: str) -> None:
    for workload, template, container in pdserve_containers(rendered(name)):
        if workload["metadata"]["name"] not in NODE_ROLES:
            continue
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
        assert "grpc" in container["readinessProbe"] and "grpc" in container["livenessProbe"]
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == mount["name"]]
        assert volume["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("name", RENDERINGS)
def test_node_roles_scale_separately_and_the_hpa_targets_them(name: str) -> None:
    objects = rendered(name)
    for role in NODE_ROLES:
        deployment = find(objects, "Deployment", role)
        labels = deployment["spec"]["selector"]["matchLabels"]
        assert labels["role"] == role, "each role needs its own selector to scale on its own"
    for hpa in (o for o in objects if o["kind"] == "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        find(objects, target["kind"], target["name"])
        metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
        assert all(m.startswith("pdserve_") for m in metrics)


def test_gpu_overlay_asks_for_gpus_cuda_and_more_shared_memory() -> None:
    base, gpu = rendered("base"), rendered("overlays/gpu")
    for workload, template, container in pdserve_containers(gpu):
        assert container["image"].endswith("-cuda")
        if workload["metadata"]["name"] not in NODE_ROLES:
            continue
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert " ".join(container["args"]).endswith("--device cuda")
        shm = template["spec"]["volumes"][0]["emptyDir"]["sizeLimit"]
        base_shm = find(base, "Deployment", workload["metadata"]["name"])["spec"]["template"][
            "spec"
        ]["volumes"][0]["emptyDir"]["sizeLimit"]
        assert _gibibytes(shm) > _gibibytes(base_shm)
    for _, _, container in pdserve_containers(base):
        assert "nvidia.com/gpu" not in str(container["resources"])
    assert find(gpu, "ConfigMap", "pdserve-config")["data"]["KV_TRANSPORT"] == "ucx"


def _gibibytes(quantity: str) -> float:
    units = {"Mi": 1 / 1024, "Gi": 1}
    return float(quantity[:-2]) * units[quantity[-2:]]


@pytest.mark.parametrize("name", RENDERINGS)
def test_the_image_exposes_every_port_the_manifests_declare(name: str) -> None:
    exposed = {
        int(port)
        for step in dockerfile.instructions()
        if step.keyword == "EXPOSE"
        for port in step.arguments.split()
    }
    for workload, _, container in pdserve_containers(rendered(name)):
        declared = {p["containerPort"] for p in container["ports"]}
        assert declared <= exposed, f"{workload['metadata']['name']}: {declared - exposed}"
