"""The Grafana dashboard (deploy/grafana/dlserve.json) and the autoscaling overlay's rules query
only metrics the server exports.

Every query's metric names are read out of its PromQL; a server that has served traffic (plain
inferences, a failed one, a system shared-memory inference) is scraped, and every name must be
a family on its /metrics. The GPU panels' names appear only where NVML sees a GPU: there they
are checked on the live output (``gpu``), elsewhere against the families the server's GPU
collector exports.
"""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
import yaml
from tritonclient.utils import InferenceServerException

from conftest import EXAMPLES, RunningServer, repository_of, run_server
from dlserve.server.core.telemetry.system_metrics import _GPU_FAMILIES

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dlserve.json"
ADAPTER_RULES = ROOT / "deploy" / "kubernetes" / "overlays" / "autoscaling"
GPU_NAMES = {name for name, _, _ in _GPU_FAMILIES}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (Grafana's variables stripped)."""
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", expr)  # grouping labels
    expr = re.sub(r"<<[^>]*>>", "", expr)  # prometheus-adapter's templates
    expr = re.sub(r"(?<![\w.])\d+(\.\d+)?([eE][+-]?\d+)?", "", expr)  # numbers
    names = set()
    for found in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
        word, after = found[0], expr[found.end() :].lstrip()
        if after.startswith("(") or word in PROMQL_WORDS:
            continue
        names.add(word)
    return names


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return queries


def adapter_queries() -> list[str]:
    rules_map = yaml.safe_load((ADAPTER_RULES / "prometheus-adapter-rules.yaml").read_text())
    rules = yaml.safe_load(rules_map["data"]["config.yaml"])["rules"]
    return [r[key] for r in rules for key in ("seriesQuery", "metricsQuery")]


def queried() -> set[str]:
    names = set().union(*(metric_names(q) for q in dashboard_queries() + adapter_queries()))
    return {n for n in names if n not in ("label_values", "model")}


def families(text: str) -> set[str]:
    return set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repository = repository_of(tmp_path_factory.mktemp("repo"), EXAMPLES / "add_sub")
    with run_server(repository) as server:
        yield server


def traffic(server: RunningServer) -> None:
    """Successes, a failure, and a shared-memory inference with its region registered."""
    client = httpclient.InferenceServerClient(server.http_url)
    a = np.arange(4, dtype=np.float32)
    inputs = [httpclient.InferInput(n, [4], "FP32") for n in ("INPUT0", "INPUT1")]
    for tensor in inputs:
        tensor.set_data_from_numpy(a)
    for _ in range(3):
        client.infer("add_sub", inputs)
    short = [httpclient.InferInput("INPUT0", [4], "FP32")]
    short[0].set_data_from_numpy(a)
    with pytest.raises(InferenceServerException):
        client.infer("add_sub", short)
    name = f"dashboard_{uuid.uuid4().hex}"
    handle = shm.create_shared_memory_region(name, f"/{name}", 2 * a.nbytes)
    shm.set_shared_memory_region(handle, [a, a])
    client.register_system_shared_memory(name, f"/{name}", 2 * a.nbytes)
    inputs[0].set_shared_memory(name, a.nbytes, 0)
    inputs[1].set_shared_memory(name, a.nbytes, a.nbytes)
    client.infer("add_sub", inputs)
    shm.destroy_shared_memory_region(handle)  # stays registered: the gauge counts it


def scrape(server: RunningServer) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text: str = response.read().decode()
    return text


def test_the_queries_name_metrics() -> None:
    """The parser finds what the queries read (so the next tests can fail)."""
    assert metric_names(
        'sum by (model) (rate(nv_inference_queue_duration_us{model=~"$model"}[5m])) / '
        "clamp_min(sum by (model) (rate(nv_inference_request_success[5m])), 1e-9)"
    ) == {"nv_inference_queue_duration_us", "nv_inference_request_success"}
    assert "dlserve_shm_regions" in queried() and GPU_NAMES & queried()


def test_every_metric_the_dashboard_queries_is_served(server: RunningServer) -> None:
    traffic(server)
    text = scrape(server)
    served = families(text)
    missing = (queried() - GPU_NAMES) - served
    assert not missing, f"queried but not served: {sorted(missing)}"
    assert re.search(r'^dlserve_shm_regions\{kind="system"\} [1-9]', text, re.MULTILINE), text
    assert re.search(r'^nv_inference_request_failure\{model="add_sub".*\} [1-9]', text, re.M)


def test_the_gpu_panels_query_the_gpu_collectors_names() -> None:
    assert queried() & {n for n in GPU_NAMES if n.startswith("nv_gpu")} <= GPU_NAMES


@pytest.mark.gpu
def test_the_gpu_panels_metrics_are_served(server: RunningServer) -> None:
    text = scrape(server)
    if "nv_gpu_utilization" not in families(text):
        pytest.skip("NVML sees no GPU here")
    missing = (queried() & GPU_NAMES) - families(text)
    assert not missing, f"queried but not served: {sorted(missing)}"
