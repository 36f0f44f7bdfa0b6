"""The Kubernetes and KServe manifests: they render, they validate, and what they name is what
the server serves.

- Every kustomization under deploy/kubernetes and deploy/kserve renders with ``kubectl
  kustomize``.
- Every Kubernetes resource validates, strictly (an unknown field is an error), against the
  Kubernetes OpenAPI schemas kubernetes-validate ships; KServe's ServingRuntime and
  InferenceService against the schema of the KServe SDK's models (``kserve_schema.json``,
  made by tools/kserve_schema.py, whose docstring says why it is not the SDK itself).
- Each server container (the Deployment of every overlay, the ServingRuntime) is started with
  its own arguments (the model repository and the ports moved to this machine's), and each of
  its probes is called as the kubelet calls it: HTTP GET on its path, gRPC's standard health
  check; the declared container ports are the ones the arguments give, and Prometheus'
  annotations name the metrics port.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

from conftest import EXAMPLES, RunningServer, repository_of, run_server

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZATIONS = sorted(
    path.parent.relative_to(ROOT).as_posix()
    for folder in ("deploy/kubernetes", "deploy/kserve")
    for path in (ROOT / folder).rglob("kustomization.yaml")
)
K8S_VERSION = "1.37.0"
KSERVE_SCHEMA = json.loads(Path(__file__).with_name("kserve_schema.json").read_text())
KSERVE_KINDS = {"serving.kserve.io/v1alpha1", "serving.kserve.io/v1beta1"}
PORT_OPTIONS = {"--http-port": "http", "--grpc-port": "grpc", "--metrics-port": "metrics"}
SERVING = b"\x08\x01"  # grpc.health.v1.HealthCheckResponse{status: SERVING}

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")


def render(kustomization: str) -> list[dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / kustomization)],
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    return [doc for doc in yaml.safe_load_all(out) if doc]


def servers(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(the pod's annotations, the server container) of each Deployment and ServingRuntime."""
    for doc in docs:
        if doc["kind"] == "Deployment":
            template = doc["spec"]["template"]
            pod_annotations = template["metadata"].get("annotations", {})
            yield pod_annotations, template["spec"]["containers"][0]
        elif doc["kind"] in ("ServingRuntime", "ClusterServingRuntime"):
            yield doc["spec"].get("annotations", {}), doc["spec"]["containers"][0]


def validate_kserve(doc: dict[str, Any]) -> None:
    definitions = schema_contents(
        f"kubernetes-json-schema/v{K8S_VERSION}-local-strict/_definitions.json", K8S_VERSION
    )
    schema = {**KSERVE_SCHEMA, "$ref": f"#/$defs/{KSERVE_SCHEMA['kinds'][doc['kind']]}"}
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    jsonschema.Draft202012Validator(schema, registry=registry).validate(doc)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_renders_and_validates(kustomization: str) -> None:
    docs = render(kustomization)
    assert docs
    for doc in docs:
        if doc["apiVersion"] in KSERVE_KINDS:
            validate_kserve(doc)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_a_wrong_field_fails_validation() -> None:
    """The validation can fail: a misspelt field in each kind of resource is refused."""
    for kustomization in ("deploy/kubernetes/base", "deploy/kserve"):
        for doc in render(kustomization):
            doc["spec"]["replicass"] = 1
            with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
                if doc["apiVersion"] in KSERVE_KINDS:
                    validate_kserve(doc)
                else:
                    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize(
    ("kind", "path"),
    [
        ("ServingRuntime", ("spec", "containers", 0)),
        ("InferenceService", ("spec", "predictor", "model")),
    ],
)
def test_a_wrong_field_deep_in_a_kserve_resource_fails(
    kind: str, path: tuple[str | int, ...]
) -> None:
    """Deep too: a container's fields (Kubernetes' own definitions) and KServe's model spec."""
    (doc,) = [d for d in render("deploy/kserve") if d["kind"] == kind]
    validate_kserve(doc)
    inner = doc
    for key in path:
        inner = inner[key]
    inner["storageUrl"] = "gs://misspelt"
    with pytest.raises(jsonschema.ValidationError, match="storageUrl"):
        validate_kserve(doc)


def local_arguments(
    args: list[str], repository: Path, folder: Path
) -> tuple[list[str], dict[str, int]]:
    """The container's arguments with its paths and ports moved to this machine: the model
    repository to ``repository``, a Unix socket into ``folder``, each port to 0 (any free
    one). Returns them and the port each endpoint was given."""
    moved, ports = [], {}
    for arg in args:
        option, _, value = arg.partition("=")
        if option == "--model-repository":
            arg = f"{option}={repository}"
        elif option == "--grpc-uds":
            arg = f"{option}={folder / Path(value).name}"
        elif option in PORT_OPTIONS:
            ports[PORT_OPTIONS[option]] = int(value)
            arg = f"{option}=0"
        moved.append(arg)
    return moved, ports


def local_port(port: int | str, container: dict[str, Any], declared: dict[str, int],
               server: RunningServer) -> int:  # fmt: skip
    """The port on this machine of a probe's port (a number or a container port's name)."""
    number = port if isinstance(port, int) else next(
        p["containerPort"] for p in container["ports"] if p.get("name") == port
    )  # fmt: skip
    endpoint = next(name for name, value in declared.items() if value == number)
    return {"http": server.http_port, "grpc": server.grpc_port,
            "metrics": server.metrics_port}[endpoint]  # fmt: skip


def call_probe(probe: dict[str, Any], container: dict[str, Any], declared: dict[str, int],
               server: RunningServer) -> None:  # fmt: skip
    if "httpGet" in probe:
        port = local_port(probe["httpGet"]["port"], container, declared, server)
        url = f"http://127.0.0.1:{port}{probe['httpGet']['path']}"
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.status == 200, url
    else:
        port = local_port(probe["grpc"]["port"], container, declared, server)
        request = b"" if not probe["grpc"].get("service") else b"\x0a" + bytes(
            [len(probe["grpc"]["service"])]) + probe["grpc"]["service"].encode()  # fmt: skip
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = channel.unary_unary("/grpc.health.v1.Health/Check")
            assert check(request, timeout=5) == SERVING


def container_cases() -> list[tuple[str, int]]:
    return [(k, i) for k in KUSTOMIZATIONS
            for i, _ in enumerate(servers(render(k)))]  # fmt: skip


@pytest.mark.parametrize(("kustomization", "index"), container_cases())
def test_the_server_serves_what_the_manifest_names(kustomization: str, index: int,
                                                  tmp_path: Path) -> None:  # fmt: skip
    annotations, container = list(servers(render(kustomization)))[index]
    assert container["command"] == ["dlserve", "serve"]
    repository = repository_of(tmp_path / "models", EXAMPLES / "add_sub")
    args, declared = local_arguments(container["args"], repository, tmp_path)
    for port in container.get("ports", []):  # every declared port is one the server serves
        assert port["containerPort"] in declared.values(), port
    metrics_port = annotations.get("prometheus.io/port") or annotations.get(
        "prometheus.kserve.io/port")  # fmt: skip
    assert int(metrics_port) == declared["metrics"]
    with run_server(repository, *args) as server:
        probes = [container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")
                  if k in container]  # fmt: skip
        assert probes
        for probe in probes:
            call_probe(probe, container, declared, server)
        path = annotations.get("prometheus.io/path") or annotations["prometheus.kserve.io/path"]
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}{path}") as response:
            assert b"nv_inference_count" in response.read()
        for arg in args:
            if arg.startswith("--grpc-uds="):
                with grpc.insecure_channel(f"unix:{arg.partition('=')[2]}") as channel:
                    check = channel.unary_unary("/grpc.health.v1.Health/Check")
                    assert check(b"", timeout=5) == SERVING
