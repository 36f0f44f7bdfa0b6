"""Triton's CPU and GPU metrics on the metrics endpoint (nv_cpu_*, nv_gpu_*)."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import EXAMPLES, RunningServer, repository_of, run_server
from dlserve.server.core.host.devices import gpu_count

HAS_GPU = gpu_count() > 0


def scrape(server: RunningServer) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(server.metrics_url, timeout=60) as response:
        text = response.read().decode()
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):  # by family: the parser names a
        for sample in family.samples:  # counter's samples <name>_total
            found.setdefault(family.name, []).append((sample.labels, float(sample.value)))
    return found


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def test_cpu_utilization_and_memory(example_server: RunningServer) -> None:
    scrape(example_server)  # the next utilization covers what happens from here
    spent = time.process_time()
    while time.process_time() - spent < 0.2:  # work, so that the CPUs are not idle
        pass
    metrics = scrape(example_server)
    [(_, utilization)] = metrics["nv_cpu_utilization"]
    assert 0.0 < utilization <= 1.0
    [(_, total)] = metrics["nv_cpu_memory_total_bytes"]
    [(_, used)] = metrics["nv_cpu_memory_used_bytes"]
    assert total == mem_total()
    assert 0 < used < total


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
def test_gpu_metrics_per_gpu(example_server: RunningServer) -> None:
    metrics = scrape(example_server)
    totals = metrics["nv_gpu_memory_total_bytes"]
    assert len(totals) == gpu_count()
    for labels, total in totals:
        assert labels["gpu_uuid"].startswith("GPU-")
        assert total > 2**30
    for labels, used in metrics["nv_gpu_memory_used_bytes"]:
        assert 0 <= used <= dict((lab["gpu_uuid"], t) for lab, t in totals)[labels["gpu_uuid"]]
    assert all(0.0 <= u <= 1.0 for _, u in metrics["nv_gpu_utilization"])
    assert all(p > 0 for _, p in metrics["nv_gpu_power_usage"])
    assert all(p > 0 for _, p in metrics["nv_gpu_power_limit"])
    assert all(e >= 0 for _, e in metrics["nv_energy_consumption"])


@pytest.mark.parametrize(
    "kind", ["cpu", pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not HAS_GPU, reason="no CUDA device")])],
)  # fmt: skip
def test_allow_metrics_of_a_kind_false_leaves_them_out(tmp_path: Path, kind: str) -> None:
    """Triton's --allow-cpu-metrics / --allow-gpu-metrics false: that kind's nv_* families
    are not reported; the other kind and the inference metrics still are."""
    repository = repository_of(tmp_path, EXAMPLES / "add_sub")
    names = {"cpu": "nv_cpu_utilization", "gpu": "nv_gpu_utilization"}
    with run_server(repository, f"--allow-{kind}-metrics", "false") as server:
        metrics = scrape(server)
    assert names[kind] not in metrics
    assert "nv_inference_request_success" in metrics
    other = "gpu" if kind == "cpu" else "cpu"
    if other == "cpu" or HAS_GPU:
        assert names[other] in metrics
