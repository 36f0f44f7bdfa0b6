"""Server readiness (``--strict-readiness``, default true as in Triton): a model that failed
to load makes the server not ready until it loads or is unloaded."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import TEST_MODELS, run_server


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    for model in ("plain", "bad_config"):
        shutil.copytree(TEST_MODELS / model, tmp_path / model)
    return tmp_path


def readiness(grpc_url: str, http_url: str) -> tuple[bool, bool]:
    with grpcclient.InferenceServerClient(grpc_url) as g:
        over_grpc = g.is_server_ready()
    h = httpclient.InferenceServerClient(http_url)
    try:
        return over_grpc, h.is_server_ready()
    finally:
        h.close()


def test_a_model_that_failed_to_load_makes_the_server_not_ready(repository: Path) -> None:
    loaded = ("--model-control-mode", "explicit", "--load-model", "*", "--exit-on-error", "false")
    with run_server(repository, *loaded) as s:
        assert readiness(s.grpc_url, s.http_url) == (False, False)
        with grpcclient.InferenceServerClient(s.grpc_url) as client:
            assert client.is_server_live()
            assert client.is_model_ready("plain")  # the others serve all the same
            client.unload_model("bad_config")
            assert readiness(s.grpc_url, s.http_url) == (True, True)
            client.unload_model("plain")  # unloaded models do not count
            assert readiness(s.grpc_url, s.http_url) == (True, True)


def test_without_strict_readiness_the_server_is_ready_once_started(repository: Path) -> None:
    with run_server(repository, "--strict-readiness", "false", "--exit-on-error", "false") as s:
        assert readiness(s.grpc_url, s.http_url) == (True, True)
