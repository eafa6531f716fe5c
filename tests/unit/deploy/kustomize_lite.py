"""A tiny kustomize for the offline checks of deploy/k8s: only the features the manifests use,
and an error for anything else, so a manifest cannot silently rely on something unrendered.

```
render(folder) -> [object, ...]      folder holds kustomization.yaml (Kustomization)
  resources:   YAML files (several documents each) and folders (rendered recursively)
  components:  folders holding a Component (its resources, images and patches apply here)
  namespace:   set on every namespaced object
  images:      name -> newName / newTag / digest, on every pod template's containers
  patches:     JSON patches (RFC 6902: add, replace, remove) from `path` or inline `patch`,
               on the objects `target` names by kind and name
```

When a kustomize binary is at hand (`kubectl kustomize`), tests compare the two renderings.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_KEYS = {
    "apiVersion", "kind", "namespace", "resources", "components", "images", "patches",
}  # fmt: skip
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass"}
POD_TEMPLATE_PATHS = (("spec", "template", "spec"), ("spec",))


class UnsupportedFeature(ValueError):
    """The kustomization uses something this renderer does not implement."""


def render(folder: Path) -> list[dict[str, Any]]:
    return _build(Path(folder), expected_kind="Kustomization")


def _build(folder: Path, expected_kind: str, objects: list | None = None) -> list[dict]:
    spec = _load_kustomization(folder, expected_kind)
    objects = [] if objects is None else objects
    for entry in spec.get("resources", []):
        path = folder / entry
        objects += render(path) if path.is_dir() else _load_documents(path)
    for entry in spec.get("components", []):
        objects = _build(folder / entry, expected_kind="Component", objects=objects)
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = spec["namespace"]
    for image in spec.get("images", []):
        _set_image(objects, image)
    for patch in spec.get("patches", []):
        _apply_patch(objects, patch, folder)
    return objects


def _load_kustomization(folder: Path, expected_kind: str) -> dict[str, Any]:
    path = folder / "kustomization.yaml"
    spec = yaml.safe_load(path.read_text())
    unknown = set(spec) - KUSTOMIZATION_KEYS
    if unknown:
        raise UnsupportedFeature(f"{path}: {sorted(unknown)} not implemented here")
    if spec.get("kind", "Kustomization") != expected_kind:
        raise UnsupportedFeature(f"{path}: kind {spec.get('kind')}, expected {expected_kind}")
    return spec


def _load_documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _set_image(objects: list[dict], image: dict[str, str]) -> None:
    unknown = set(image) - {"name", "newName", "newTag", "digest"}
    if unknown:
        raise UnsupportedFeature(f"images: {sorted(unknown)} not implemented here")
    for container in _containers(objects):
        name, tag = _split_image(container.get("image", ""))
        if name != image["name"]:
            continue
        name = image.get("newName", name)
        if "digest" in image:
            container["image"] = f"{name}@{image['digest']}"
        else:
            tag = image.get("newTag", tag)
            container["image"] = f"{name}:{tag}" if tag else name


def _split_image(reference: str) -> tuple[str, str | None]:
    reference = reference.split("@", 1)[0]
    name, _, tag = reference.rpartition(":")
    if not name or "/" in tag:  # no tag (a colon, if any, belongs to a registry's port)
        return reference, None
    return name, tag


def _containers(objects: list[dict]):
    for obj in objects:
        for path in POD_TEMPLATE_PATHS:
            pod = obj
            for key in path:
                pod = pod.get(key, {}) if isinstance(pod, dict) else {}
            for key in ("initContainers", "containers"):
                yield from pod.get(key, []) if isinstance(pod, dict) else []


def _apply_patch(objects: list[dict], patch: dict[str, Any], folder: Path) -> None:
    unknown = set(patch) - {"path", "patch", "target"}
    target = patch.get("target", {})
    if unknown or set(target) - {"kind", "name"} or not target:
        raise UnsupportedFeature(f"patch {patch}: only `target: {{kind, name}}` is implemented")
    text = (folder / patch["path"]).read_text() if "path" in patch else patch["patch"]
    operations = yaml.safe_load(text)
    if not isinstance(operations, list):
        raise UnsupportedFeature("only JSON patches (a list of operations) are implemented")
    matched = [
        obj for obj in objects
        if obj["kind"] == target.get("kind", obj["kind"])
        and obj["metadata"]["name"] == target.get("name", obj["metadata"]["name"])
    ]  # fmt: skip
    if not matched:
        raise ValueError(f"patch target {target} matches no object")
    for obj in matched:
        for operation in operations:
            json_patch(obj, operation)


def json_patch(document: dict, operation: dict[str, Any]) -> None:
    """One RFC 6902 operation (add, replace, remove) on `document`, in place."""
    op, pointer = operation["op"], operation["path"]
    keys = [k.replace("~1", "/").replace("~0", "~") for k in pointer.split("/")[1:]]
    parent = document
    for key in keys[:-1]:
        parent = parent[int(key)] if isinstance(parent, list) else parent[key]
    last = keys[-1]
    value = copy.deepcopy(operation.get("value"))
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if op == "add":
            parent.insert(index, value)
        elif op == "replace":
            parent[index] = value
        elif op == "remove":
            del parent[index]
        else:
            raise UnsupportedFeature(f"JSON patch op {op!r}")
        return
    if op in ("replace", "remove") and last not in parent:
        raise KeyError(f"{op} {pointer}: no such member")
    if op in ("add", "replace"):
        parent[last] = value
    elif op == "remove":
        del parent[last]
    else:
        raise UnsupportedFeature(f"JSON patch op {op!r}")
