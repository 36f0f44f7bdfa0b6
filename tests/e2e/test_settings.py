"""Server-wide settings are one state whichever protocol changes them."""

from __future__ import annotations

import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import RunningServer


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
