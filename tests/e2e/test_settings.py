"""Server-wide settings are one state whichever protocol changes them."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import EXAMPLES, TEST_MODELS, RunningServer, run_server


def test_trace_settings_set_over_grpc_show_over_http(example_server: RunningServer) -> None:
    grpc = grpcclient.InferenceServerClient(example_server.grpc_url)
    http = httpclient.InferenceServerClient(example_server.http_url)
    try:
        grpc.update_trace_settings(settings={"trace_rate": "7"})
        assert http.get_trace_settings()["trace_rate"] == "7"
        http.update_trace_settings(model_name="add_sub", settings={"trace_count": "3"})
        settings = grpc.get_trace_settings(model_name="add_sub", as_json=True)["settings"]
        assert settings["trace_count"]["value"] == ["3"]
        assert settings["trace_rate"]["value"] == ["7"]
    finally:
        grpc.update_trace_settings(settings={"trace_rate": None})
        http.update_trace_settings(model_name="add_sub", settings={"trace_count": None})
    assert http.get_trace_settings()["trace_rate"] == "1000"
    grpc.close()
    http.close()


def _worker_log_settings(client: httpclient.InferenceServerClient, model: str) -> list[bytes]:
    tensor = httpclient.InferInput("INPUT0", [1], "FP32")
    tensor.set_data_from_numpy(np.zeros(1, np.float32))
    return list(client.infer(model, [tensor]).as_numpy("OUTPUT0"))


def test_log_settings_reach_running_and_new_workers(test_server: RunningServer) -> None:
    """pb_utils.Logger follows the log settings changed at run time: the running worker is
    told before its next request, and a worker started afterwards starts with them."""
    client = httpclient.InferenceServerClient(test_server.http_url)
    try:
        assert _worker_log_settings(client, "log_levels") == [
            b"0",
            b"info,warning,error",
            b"default",
        ]
        client.update_log_settings({"log_verbose_level": 2, "log_info": False})
        assert _worker_log_settings(client, "log_levels") == [b"2", b"warning,error", b"default"]
        client.unload_model("log_levels")
        client.load_model("log_levels")  # a new worker process
        assert _worker_log_settings(client, "log_levels") == [b"2", b"warning,error", b"default"]
    finally:
        client.update_log_settings({"log_verbose_level": 0, "log_info": True})
    assert _worker_log_settings(client, "log_levels") == [b"0", b"info,warning,error", b"default"]
    client.close()


def test_log_verbose_at_startup_shows_in_the_log_settings() -> None:
    with run_server(EXAMPLES, "--log-verbose", "1") as server:
        client = httpclient.InferenceServerClient(server.http_url)
        assert client.get_log_settings()["log_verbose_level"] == 1
        client.close()


def test_log_levels_at_startup_reach_the_settings_and_the_workers(tmp_path: Path) -> None:
    shutil.copytree(TEST_MODELS / "log_levels", tmp_path / "log_levels")
    with run_server(tmp_path, "--log-info", "false", "--log-warning=false") as server:
        client = httpclient.InferenceServerClient(server.http_url)
        settings = client.get_log_settings()
        assert (settings["log_info"], settings["log_warning"], settings["log_error"]) == (
            False, False, True,
        )  # fmt: skip
        assert _worker_log_settings(client, "log_levels") == [b"0", b"error", b"default"]
        client.close()


def test_the_iso8601_log_format_reaches_the_workers(test_server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(test_server.http_url)
    try:
        assert client.update_log_settings({"log_format": "ISO8601"})["log_format"] == "ISO8601"
        assert _worker_log_settings(client, "log_levels")[2] == b"ISO8601"
    finally:
        client.update_log_settings({"log_format": "default"})
    assert _worker_log_settings(client, "log_levels")[2] == b"default"
    client.close()


def test_log_file_receives_the_servers_and_the_models_lines(tmp_path: Path) -> None:
    """--log-file: the server's log lines and the models' pb_utils.Logger lines (the
    workers inherit the server's stderr) are appended to the file; the settings name it."""
    shutil.copytree(EXAMPLES / "double", tmp_path / "repo" / "double")
    log = tmp_path / "server.log"
    with run_server(tmp_path / "repo", "--log-file", str(log)) as server:
        client = httpclient.InferenceServerClient(server.http_url)
        assert client.get_log_settings()["log_file"] == str(log)
        client.close()
    text = log.read_text()
    assert "model 'double' versions [1] are READY" in text  # the server's own line
    assert "] [model 'double'] double computes on" in text  # the model's Logger line
