"""Shutdown and crash behaviour of the whole server process.

- SIGTERM while a request is in flight: the request completes, workers exit, the
  server exits 0, and nothing of the server is left in /dev/shm; the same when SIGTERM
  goes to the whole process group (as systemd and ``timeout`` send it).
- SIGKILL of the server: its workers die with it (no orphans).
"""

from __future__ import annotations

import os
import queue
import signal
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient

from conftest import TEST_MODELS, run_server, stop_server


def _shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _slow_request(fifo: Path) -> list[grpcclient.InferInput]:
    data = np.array([str(fifo).encode()], dtype=np.object_)
    inputs = [grpcclient.InferInput("INPUT0", [1], "BYTES")]
    inputs[0].set_data_from_numpy(data)
    return inputs


@pytest.mark.parametrize("to_the_group", [False, True], ids=["server", "process-group"])
def test_sigterm_lets_the_request_in_flight_finish(tmp_path: Path, to_the_group: bool) -> None:
    before = _shm_names()
    fifo = tmp_path / "started"
    os.mkfifo(fifo)
    extra = ("--model-control-mode", "explicit", "--load-model", "slow")
    with run_server(TEST_MODELS, *extra, new_session=to_the_group) as s:
        workers = psutil.Process(s.process.pid).children(recursive=True)
        assert workers, "the slow model's worker should be running"
        client = grpcclient.InferenceServerClient(s.grpc_url)
        results: queue.Queue[object] = queue.Queue()
        client.async_infer(
            "slow", _slow_request(fifo), lambda result, error: results.put(error or result)
        )
        with open(fifo) as started:  # blocks until execute has begun
            assert started.readline() == "started\n"
        if to_the_group:  # the workers get it too: they must leave stopping to the server
            os.killpg(s.process.pid, signal.SIGTERM)
        else:
            s.process.send_signal(signal.SIGTERM)
        result = results.get(timeout=30)
        assert isinstance(result, grpcclient.InferResult), result
        assert result.as_numpy("OUTPUT0")[0] == str(fifo).encode()
        assert s.process.wait(timeout=30) == 0
        client.close()
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive
    assert _shm_names() <= before


def test_workers_die_with_a_killed_server() -> None:
    with run_server(TEST_MODELS, "--model-control-mode", "explicit", "--load-model", "plain") as s:
        workers = psutil.Process(s.process.pid).children(recursive=True)
        assert workers
        s.process.kill()
        s.process.wait(timeout=10)
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"orphaned workers: {alive}"
        stop_server(s)


def test_exit_timeout_bounds_the_wait_for_a_request_that_does_not_finish(tmp_path: Path) -> None:
    """--exit-timeout-secs 1: SIGTERM while a request will never finish (its model waits on a
    pipe nobody writes); the server still exits, the client gets an error, no worker or
    shared-memory object is left."""
    import time

    before = _shm_names()
    started, never = tmp_path / "started", tmp_path / "never"
    os.mkfifo(started)
    os.mkfifo(never)
    extra = (
        "--model-control-mode",
        "explicit",
        "--load-model",
        "gated",
        "--exit-timeout-secs",
        "1",
    )
    with run_server(TEST_MODELS, *extra) as s:
        workers = psutil.Process(s.process.pid).children(recursive=True)
        client = grpcclient.InferenceServerClient(s.grpc_url)
        control = grpcclient.InferInput("CONTROL", [2], "BYTES")
        control.set_data_from_numpy(
            np.array([str(started).encode(), str(never).encode()], dtype=np.object_)
        )
        data = grpcclient.InferInput("DATA", [1], "FP32")
        data.set_data_from_numpy(np.array([1.0], dtype=np.float32))
        results: queue.Queue[object] = queue.Queue()
        client.async_infer(
            "gated", [control, data], lambda result, error: results.put(error or result)
        )
        with open(started) as fifo:  # blocks until execute has begun
            assert fifo.readline() == "started\n"
        sent = time.monotonic()
        s.process.send_signal(signal.SIGTERM)
        s.process.wait(timeout=30)
        took = time.monotonic() - sent
        assert isinstance(results.get(timeout=30), Exception)
        client.close()
    assert took < 10, f"shutdown took {took:.1f} s with --exit-timeout-secs 1"
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive
    assert _shm_names() <= before


@pytest.mark.parametrize("off", ["grpc", "http", "metrics"])
def test_an_endpoint_can_be_switched_off(off: str) -> None:
    """--allow-grpc / --allow-http / --allow-metrics false: that endpoint is not served, the
    others are."""
    import tritonclient.http as httpclient

    extra = ("--model-control-mode", "explicit", "--load-model", "plain", f"--allow-{off}", "false")
    with run_server(TEST_MODELS, *extra) as s:
        ports = {"grpc": s.grpc_port, "http": s.http_port, "metrics": s.metrics_port}
        assert ports[off] == -1
        assert all(port > 0 for name, port in ports.items() if name != off)
        if off != "grpc":
            with grpcclient.InferenceServerClient(s.grpc_url) as client:
                assert client.is_model_ready("plain")
        if off != "http":
            client = httpclient.InferenceServerClient(s.http_url)
            assert client.is_model_ready("plain")
            client.close()


def test_switching_off_both_inference_endpoints_is_refused() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "dlserve", "serve", "--model-repository", str(TEST_MODELS),
         "--allow-grpc", "false", "--allow-http", "false"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "nothing would serve requests" in done.stderr
