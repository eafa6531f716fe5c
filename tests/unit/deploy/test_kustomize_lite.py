"""The small renderer the deploy checks use: its JSON patches, image rewriting, and refusals
(so that CI without a kustomize binary still renders what kustomize would)."""

from __future__ import annotations

import pytest
import yaml

from tests.unit.deploy.kustomize_lite import UnsupportedFeature, json_patch, render


def test_json_patch_add_replace_remove() -> None:
    doc = {"spec": {"args": ["a"], "resources": {"limits": {"cpu": "1"}}}}
    json_patch(doc, {"op": "add", "path": "/spec/args/-", "value": "b"})
    json_patch(doc, {"op": "add", "path": "/spec/args/0", "value": "z"})
    json_patch(doc, {"op": "replace", "path": "/spec/resources/limits/cpu", "value": "2"})
    json_patch(doc, {"op": "add", "path": "/spec/nvidia.com~1gpu", "value": 1})
    json_patch(doc, {"op": "remove", "path": "/spec/args/1"})
    assert doc == {"spec": {"args": ["z", "b"], "resources": {"limits": {"cpu": "2"}},
                            "nvidia.com/gpu": 1}}  # fmt: skip
    with pytest.raises(KeyError):
        json_patch(doc, {"op": "replace", "path": "/spec/missing", "value": 1})


def _write(folder, name, content) -> None:
    (folder / name).write_text(
        yaml.safe_dump_all(content) if isinstance(content, list) else content
    )


def _deployment(image: str) -> dict:
    pod = {"containers": [{"name": "c", "image": image}]}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
            "spec": {"template": {"spec": pod}}}  # fmt: skip


def test_images_namespace_and_inline_patch(tmp_path) -> None:
    _write(tmp_path, "objects.yaml", [_deployment("registry:5000/pdserve"),
                                      {"apiVersion": "v1", "kind": "Namespace",
                                       "metadata": {"name": "n"}}])  # fmt: skip
    _write(
        tmp_path,
        "kustomization.yaml",
        """
namespace: n
resources: [objects.yaml]
images:
  - {name: "registry:5000/pdserve", newTag: v1}
patches:
  - target: {kind: Deployment, name: d}
    patch: |-
      - {op: add, path: /spec/replicas, value: 3}
""",
    )
    deployment, namespace = render(tmp_path)
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "registry:5000/pdserve:v1"
    )
    assert deployment["metadata"]["namespace"] == "n" and deployment["spec"]["replicas"] == 3
    assert "namespace" not in namespace["metadata"]


@pytest.mark.parametrize(
    "kustomization",
    [
        "resources: [objects.yaml]\ncommonLabels: {a: b}\n",
        "resources: [objects.yaml]\npatches:\n  - {target: {kind: Deployment}, patch: 'spec: {}'}\n",
        "resources: [objects.yaml]\npatches:\n  - {target: {labelSelector: a=b}, patch: '[]'}\n",
    ],
)
def test_unimplemented_features_are_refused(tmp_path, kustomization: str) -> None:
    _write(tmp_path, "objects.yaml", [_deployment("pdserve")])
    _write(tmp_path, "kustomization.yaml", kustomization)
    with pytest.raises(UnsupportedFeature):
        render(tmp_path)


def test_a_patch_that_matches_nothing_fails(tmp_path) -> None:
    _write(tmp_path, "objects.yaml", [_deployment("pdserve")])
    _write(tmp_path, "kustomization.yaml",
           "resources: [objects.yaml]\npatches:\n  - {target: {kind: Deployment, name: x}, "
           "patch: '[]'}\n")  # fmt: skip
    with pytest.raises(ValueError, match="matches no object"):
        render(tmp_path)
