"""Write the JSON schema of KServe's resources, as the KServe Python SDK's models define them,
to ``tests/deploy/kserve_schema.json`` (which ``tests/deploy/test_manifests.py`` validates
``deploy/kserve/`` against).

The SDK (``pip install kserve``) pulls about 70 packages (pandas, fastapi, the kubernetes
client, ...; 450 MB, and it pins psutil below the server's), too much for the test extra, so
its models are read once, here, in a virtual environment of their own, and the schema they
make is kept in the repository with the SDK's version:

    python3 -m venv /tmp/kserve-sdk
    /tmp/kserve-sdk/bin/pip install 'kserve==0.21.0' 'kubernetes-validate==1.37.0'
    /tmp/kserve-sdk/bin/python tools/kserve_schema.py

Each model class becomes a definition: its ``openapi_types`` are the properties (by their
``attribute_map`` names), a property whose setter refuses ``None`` is required, and no other
property is allowed (a misspelt field is an error, as the API server's structural schema
makes it). Models the SDK takes from the kubernetes client (``V1Container``, ...) refer to
the Kubernetes OpenAPI definitions that kubernetes-validate ships (strict), which the test
resolves them against.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "tests" / "deploy" / "kserve_schema.json"
KINDS = {
    "ServingRuntime": "V1alpha1ServingRuntime",
    "ClusterServingRuntime": "V1alpha1ClusterServingRuntime",
    "InferenceService": "V1beta1InferenceService",
}
PRIMITIVES: dict[str, dict[str, Any]] = {
    "str": {"type": "string"},
    "int": {"type": "integer"},
    "float": {"type": "number"},
    "bool": {"type": "boolean"},
    "datetime": {"type": "string"},
    "date": {"type": "string"},
    "object": {},  # int-or-string, quantities and free-form objects
}


K8S_VERSION = "1.37.0"  # kubernetes-validate's schemas, which the test resolves these against
K8S_DEFINITIONS = "https://kubernetes.io/api/_definitions.json#/$defs/"  # its $id
K8S_PREFERRED = ("io.k8s.api.core.", "io.k8s.apimachinery.pkg.apis.meta.", "io.k8s.api.")


def kubernetes_definition(name: str) -> str | None:
    """``V1Container`` -> kubernetes-validate's ``io.k8s.api.core.v1.Container``, or None."""
    from kubernetes_validate.utils import schema_contents

    definitions = schema_contents(
        f"kubernetes-json-schema/v{K8S_VERSION}-local-strict/_definitions.json", K8S_VERSION
    )["$defs"]
    qualified = re.fullmatch(r"K8sIoApi([A-Z][a-z]+)V(\d+(?:alpha|beta)?\d*)([A-Z]\w*)", name)
    if qualified:  # K8sIoApiAppsV1DeploymentStrategy -> io.k8s.api.apps.v1.DeploymentStrategy
        key = f"io.k8s.api.{qualified[1].lower()}.v{qualified[2]}.{qualified[3]}"
        return key if key in definitions else None
    found = re.fullmatch(r"V(\d+(?:alpha|beta)?\d*)([A-Z]\w*)", name)
    if found is None:
        return None
    suffix = f".v{found[1]}.{found[2]}"
    for prefix in K8S_PREFERRED:
        matches = [key for key in definitions if key.startswith(prefix) and key.endswith(suffix)]
        if matches:
            return sorted(matches)[0]
    return None


def type_schema(spec: str, pending: list[str]) -> dict[str, Any]:
    if spec in PRIMITIVES:
        return PRIMITIVES[spec]
    if found := re.fullmatch(r"list\[(.+)\]", spec):
        return {"type": "array", "items": type_schema(found[1], pending)}
    if found := re.fullmatch(r"dict\(str, (.+)\)", spec):
        return {"type": "object", "additionalProperties": type_schema(found[1], pending)}
    pending.append(spec)
    return {"$ref": f"#/$defs/{spec}"}


def required(cls: type) -> list[str]:
    """The attributes whose setter refuses None (the SDK's client-side validation)."""
    from kserve.configuration import Configuration  # type: ignore[import-not-found]

    names = []
    for attribute, key in cls.attribute_map.items():  # type: ignore[attr-defined]
        instance = object.__new__(cls)
        instance.local_vars_configuration = Configuration()  # type: ignore[attr-defined]
        try:
            setattr(instance, attribute, None)
        except ValueError:
            names.append(key)
    return sorted(names)


def definition(cls: type, pending: list[str]) -> dict[str, Any]:
    properties = {
        cls.attribute_map[a]: type_schema(t, pending)  # type: ignore[attr-defined]
        for a, t in cls.openapi_types.items()  # type: ignore[attr-defined]
    }
    return {"type": "object", "properties": properties, "required": required(cls),
            "additionalProperties": False}  # fmt: skip


def main() -> int:
    import kserve
    import kserve.models

    definitions: dict[str, Any] = {}
    pending = list(KINDS.values())
    unresolved: list[str] = []
    while pending:
        name = pending.pop()
        if name in definitions:
            continue
        if hasattr(kserve.models, name):
            definitions[name] = definition(getattr(kserve.models, name), pending)
        elif (k8s := kubernetes_definition(name)) is not None:
            definitions[name] = {"$ref": K8S_DEFINITIONS + k8s}
        else:  # a type neither defines (Knative's, in statuses): any value
            definitions[name] = {}
            unresolved.append(name)
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "/kserve/schema.json",
        "$comment": f"kserve {importlib.metadata.version('kserve')} SDK models; Kubernetes types: "
        f"kubernetes-validate {K8S_VERSION}, strict (tools/kserve_schema.py)",
        "kinds": KINDS,
        "free_form": sorted(unresolved),
        "$defs": dict(sorted(definitions.items())),
    }
    OUT.write_text(json.dumps(schema, indent=None, separators=(",", ":"), sort_keys=False) + "\n")
    print(f"{OUT}: {len(definitions)} definitions; free-form: {', '.join(sorted(unresolved))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
