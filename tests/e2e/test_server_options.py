"""Triton's server options that decide where and what is served: per-endpoint addresses,
``--model-store``, ``--id``, ``--model-config-name`` and ``--exit-on-error``, each on a real
server driven by unmodified tritonclient."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import EXAMPLES, TEST_MODELS, repository_of, run_server


def _add_sub(client: grpcclient.InferenceServerClient | httpclient.InferenceServerClient) -> None:
    module = grpcclient if isinstance(client, grpcclient.InferenceServerClient) else httpclient
    a, b = np.arange(4, dtype=np.float32), np.ones(4, dtype=np.float32)
    inputs = [module.InferInput(f"INPUT{i}", [4], "FP32") for i in range(2)]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("add_sub", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)


def _refused(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(10)
        return sock.connect_ex((host, port)) != 0


def test_each_endpoint_listens_on_its_own_address(tmp_path: Path) -> None:
    repository = repository_of(tmp_path, EXAMPLES / "add_sub")
    addresses = ("--grpc-address", "127.0.0.2", "--http-address", "127.0.0.3",
                 "--metrics-address", "127.0.0.4")  # fmt: skip
    with run_server(repository, *addresses) as server:
        _add_sub(grpcclient.InferenceServerClient(f"127.0.0.2:{server.grpc_port}"))
        _add_sub(httpclient.InferenceServerClient(f"127.0.0.3:{server.http_port}"))
        url = f"http://127.0.0.4:{server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=60) as response:
            assert b"nv_inference_request_success" in response.read()
        for port in (server.grpc_port, server.http_port, server.metrics_port):
            assert _refused("127.0.0.1", port)  # not on --host's default any more


def test_metrics_follow_the_http_address_as_in_triton(tmp_path: Path) -> None:
    repository = repository_of(tmp_path, EXAMPLES / "add_sub")
    with run_server(repository, "--http-address", "127.0.0.3") as server:
        with urllib.request.urlopen(f"http://127.0.0.3:{server.metrics_port}/metrics", timeout=60):
            pass
        assert _refused("127.0.0.1", server.metrics_port)
        _add_sub(grpcclient.InferenceServerClient(server.grpc_url))  # gRPC stays on --host


def test_model_store_is_the_model_repository(tmp_path: Path) -> None:
    """Triton's older spelling; given after --model-repository, it is the one used."""
    empty = tmp_path / "empty"
    empty.mkdir()
    repository = repository_of(tmp_path / "repo", EXAMPLES / "add_sub")
    with run_server(empty, "--model-store", str(repository)) as server:
        _add_sub(httpclient.InferenceServerClient(server.http_url))


def test_id_is_the_server_name_in_its_metadata(tmp_path: Path) -> None:
    repository = repository_of(tmp_path, EXAMPLES / "add_sub")
    with run_server(repository, "--id", "inference-7") as server:
        grpc_client = grpcclient.InferenceServerClient(server.grpc_url)
        assert grpc_client.get_server_metadata().name == "inference-7"
        http_client = httpclient.InferenceServerClient(server.http_url)
        assert http_client.get_server_metadata()["name"] == "inference-7"


def test_model_config_name_picks_configs_name_pbtxt_where_a_model_has_it(tmp_path: Path) -> None:
    repository = repository_of(tmp_path, EXAMPLES / "add_sub", EXAMPLES / "identity_fp32")
    custom = repository / "add_sub" / "configs"
    custom.mkdir()
    text = (repository / "add_sub" / "config.pbtxt").read_text()
    (custom / "h100.pbtxt").write_text(
        text.replace("count: 1", "count: 2")
        + '\nparameters { key: "config" value { string_value: "h100" } }\n'
    )
    with run_server(repository, "--model-config-name", "h100") as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        config = client.get_model_config("add_sub").config
        assert config.parameters["config"].string_value == "h100"
        assert config.instance_group[0].count == 2
        workers = psutil.Process(server.process.pid).children(recursive=True)
        assert len(workers) == 3  # two add_sub instances, one identity_fp32
        _add_sub(client)
        # a model without configs/h100.pbtxt is served from its config.pbtxt
        other = client.get_model_config("identity_fp32").config
        assert "config" not in other.parameters and client.is_model_ready("identity_fp32")


def test_a_model_config_name_with_a_space_is_refused(tmp_path: Path) -> None:
    done = _serve_until_exit(tmp_path, "--model-config-name", "h 100")
    assert done.returncode == 2 and "must not contain spaces" in done.stderr


def _serve_until_exit(
    repository: Path, *args: str, mark: str = ""
) -> subprocess.CompletedProcess[str]:
    """Run a server to its end; ``mark`` goes into its environment (its workers inherit it)."""
    command = [sys.executable, "-m", "dlserve", "serve", "--model-repository", str(repository),
               "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", *args]  # fmt: skip
    env = {**os.environ, WORKER_MARK: mark} if mark else None
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize(
    "flag", [[], ["--exit-on-error"], ["--exit-on-error", "true"]], ids=["default", "bare", "true"]
)
def test_exit_on_error_stops_the_server_when_a_model_fails_to_load(
    tmp_path: Path, flag: list[str]
) -> None:
    """As Triton, by default: exit status 1, the failed model and its reason said, the good
    model's worker stopped (the server's own shared memory is memfds: nothing in /dev/shm;
    test_lifecycle.py checks /dev/shm at shutdown)."""
    repository = repository_of(tmp_path / "repo", EXAMPLES / "add_sub", TEST_MODELS / "bad_config")
    mark = uuid.uuid4().hex
    done = _serve_until_exit(repository, *flag, mark=mark)
    assert done.returncode == 1, done.stderr
    assert "failed to load all models (--exit-on-error): bad_config:" in done.stderr
    assert "add_sub" not in done.stderr.split("failed to load all models")[1]
    assert "Started GRPCInferenceService" not in done.stdout  # it stopped before serving
    # add_sub's worker was stopped: one still exiting is given a deadline, not more
    _, alive = psutil.wait_procs(_workers_of(mark), timeout=WORKER_EXIT_S)
    assert not alive


WORKER_MARK = "DLSERVE_TEST_SERVER_MARK"
WORKER_EXIT_S = 10.0


def _workers_of(mark: str) -> list[psutil.Process]:
    """The dlserve worker processes started by the server whose environment has ``mark``
    (not those of other servers running meanwhile)."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if "dlserve.worker.main" not in " ".join(process.info["cmdline"] or []):
            continue
        with contextlib.suppress(psutil.Error):  # gone meanwhile, or not ours to read
            if process.environ().get(WORKER_MARK) == mark:
                found.append(process)
    return found


@pytest.mark.parametrize(("option", "protocol"), [("--grpc-port", "gRPC"), ("--http-port", "HTTP")])
def test_a_taken_port_stops_the_server_with_the_reason(
    tmp_path: Path, option: str, protocol: str
) -> None:
    """A listener that cannot start is fatal: exit status 1 and the address in the error."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _serve_until_exit(tmp_path, option, str(port))
    assert done.returncode == 1, done.stderr
    assert f"error: cannot listen for {protocol} on 127.0.0.1:{port}" in done.stderr


def test_without_exit_on_error_the_other_models_serve(tmp_path: Path) -> None:
    repository = repository_of(tmp_path, EXAMPLES / "add_sub", TEST_MODELS / "bad_config")
    with run_server(repository, "--exit-on-error", "false") as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        assert not client.is_model_ready("bad_config")
        _add_sub(client)


def test_log_format_at_startup_reaches_the_settings_and_the_workers(tmp_path: Path) -> None:
    repository = repository_of(tmp_path, TEST_MODELS / "log_levels")
    with run_server(repository, "--log-format", "ISO8601") as server:
        client = httpclient.InferenceServerClient(server.http_url)
        assert client.get_log_settings()["log_format"] == "ISO8601"
        tensor = httpclient.InferInput("INPUT0", [1], "FP32")
        tensor.set_data_from_numpy(np.zeros(1, np.float32))  # the model says what it was told
        assert client.infer("log_levels", [tensor]).as_numpy("OUTPUT0")[2] == b"ISO8601"
        client.close()


def test_triton_tuning_options_are_accepted_and_change_nothing(tmp_path: Path) -> None:
    """A Triton command line's pool sizes, thread counts and backend settings: the server
    starts and serves (each one is named in a warning at start, see triton_options)."""
    repository = repository_of(tmp_path, EXAMPLES / "add_sub")
    tuning = ("--pinned-memory-pool-byte-size=268435456", "--cuda-memory-pool-byte-size=0:0",
              "--backend-config=python,shm-default-byte-size=1048576",
              "--backend-config", "python,stub-timeout-seconds=60", "--http-thread-count", "4",
              "--backend-directory=/opt/tritonserver/backends")  # fmt: skip
    with run_server(repository, *tuning) as server:
        _add_sub(grpcclient.InferenceServerClient(server.grpc_url))
        _add_sub(httpclient.InferenceServerClient(server.http_url))


def test_triton_feature_options_are_refused_with_their_reasons(tmp_path: Path) -> None:
    features = ("--rate-limit=execution_count", "--allow-sagemaker", "true",
                "--grpc-max-connection-age=1000", "--backend-config=default-max-batch-size=8",
                "--backend-config=python,shm-default-byte-size=1048576")  # fmt: skip
    done = _serve_until_exit(tmp_path, *features)
    assert done.returncode == 2
    reasons = ("--rate-limit: Triton's rate limiter", "--allow-sagemaker: the SageMaker",
               "--grpc-max-connection-age: closing gRPC connections after an age",
               "--backend-config=default-max-batch-size=8: a setting for every backend",
               )  # fmt: skip
    for reason in reasons:
        assert reason in done.stderr, done.stderr
    assert "Started" not in done.stdout
    assert "python,shm-default-byte-size" not in done.stderr  # a backend's own: only tuning
