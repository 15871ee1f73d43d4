"""A small kustomize renderer for the features deploy/k8s uses, so CI needs no kustomize binary.

Supported (anything else in a kustomization.yaml is an error, so the renderer cannot silently drift):
resources (files and directories), namespace, labels (metadata only), images, replicas, patches (strategic
merge from a file, matched by kind and name), configMapGenerator / secretGenerator (files, literals,
options.labels/annotations) with generatorOptions.disableNameSuffixHash: true. When `kubectl` is installed,
tests/test_deploy_k8s.py checks that `kubectl kustomize` renders the same objects.
"""
from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import yaml

KNOWN = {"apiVersion", "kind", "resources", "namespace", "labels", "images", "replicas", "patches",
         "configMapGenerator", "secretGenerator", "generatorOptions"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "PersistentVolume", "StorageClass", "PriorityClass"}
# Strategic-merge keys of the lists this project patches; other lists of objects are replaced.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
              "volumeMounts": "mountPath", "ports": "containerPort", "tolerations": None}


class RenderError(Exception):
    pass


def _load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def _merge(base: Any, patch: Any, key: str | None = None) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)  # strategic merge: null deletes the field
            elif k in out:
                out[k] = _merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    mk = MERGE_KEYS.get(key or "")
    if isinstance(base, list) and isinstance(patch, list) and mk:
        out = [copy.deepcopy(x) for x in base]
        for item in patch:
            match = next((i for i, x in enumerate(out) if x.get(mk) == item.get(mk)), None)
            if match is None:
                out.append(copy.deepcopy(item))
            else:
                out[match] = _merge(out[match], item)
        return out
    return copy.deepcopy(patch)


def _generated(kind: str, gen: dict, root: Path) -> dict:
    data: dict[str, str] = {}
    for entry in gen.get("files", []):
        key, _, rel = entry.partition("=") if "=" in entry else (Path(entry).name, "", entry)
        data[key] = (root / rel).read_text(encoding="utf-8")
    for lit in gen.get("literals", []):
        k, _, v = lit.partition("=")
        data[k] = v
    if set(gen) - {"name", "files", "literals", "options"}:
        raise RenderError(f"unsupported generator field in {sorted(set(gen))}")
    meta: dict[str, Any] = {"name": gen["name"]}
    opts = gen.get("options", {})
    if opts.get("labels"):
        meta["labels"] = dict(opts["labels"])
    if opts.get("annotations"):
        meta["annotations"] = dict(opts["annotations"])
    if kind == "Secret":
        enc = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque", "data": enc}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def _containers(obj: dict) -> list[dict]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("containers", []), *spec.get("initContainers", [])]


def render(directory: str | Path) -> list[dict]:
    """The objects `kubectl kustomize DIRECTORY` would print, in file order."""
    root = Path(directory)
    k = yaml.safe_load((root / "kustomization.yaml").read_text(encoding="utf-8")) or {}
    unknown = set(k) - KNOWN
    if unknown:
        raise RenderError(f"{root}: unsupported kustomization fields {sorted(unknown)}")
    objs: list[dict] = []
    for res in k.get("resources", []):
        path = root / res
        objs += render(path) if path.is_dir() else _load_docs(path)
    gens = [("ConfigMap", g) for g in k.get("configMapGenerator", [])]
    gens += [("Secret", g) for g in k.get("secretGenerator", [])]
    if gens and not k.get("generatorOptions", {}).get("disableNameSuffixHash"):
        raise RenderError(f"{root}: generators need generatorOptions.disableNameSuffixHash: true here")
    objs += [_generated(kind, g, root) for kind, g in gens]

    for p in k.get("patches", []):
        if set(p) != {"path"}:
            raise RenderError(f"{root}: only `patches: - path: FILE` is supported")
        for patch in _load_docs(root / p["path"]):
            idx = [i for i, o in enumerate(objs) if o["kind"] == patch["kind"]
                   and o["metadata"]["name"] == patch["metadata"]["name"]]
            if len(idx) != 1:
                raise RenderError(f"patch target {patch['kind']}/{patch['metadata']['name']} not found once")
            objs[idx[0]] = _merge(objs[idx[0]], patch)
    for rep in k.get("replicas", []):
        hits = [o for o in objs if o["metadata"]["name"] == rep["name"] and "replicas" in o.get("spec", {})]
        if not hits:
            raise RenderError(f"replicas: no workload named {rep['name']}")
        for o in hits:
            o["spec"]["replicas"] = rep["count"]
    for img in k.get("images", []):
        for o in objs:
            for c in _containers(o):
                name, _, _tag = c.get("image", "").partition(":")
                if name == img["name"]:
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', _tag)}"
    for block in k.get("labels", []):
        if set(block) != {"pairs"}:
            raise RenderError(f"{root}: only `labels: - pairs:` (metadata labels) is supported")
        for o in objs:
            o["metadata"].setdefault("labels", {}).update(block["pairs"])
    if "namespace" in k:
        for o in objs:
            if o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = k["namespace"]
    return objs
