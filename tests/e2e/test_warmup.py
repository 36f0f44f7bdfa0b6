"""config.pbtxt ``model_warmup``: samples run on each instance before the model is READY,
and a sample that cannot be built or that fails makes the model UNAVAILABLE with the
reason (tests/models/warmup_probe records every execute it sees)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import TEST_MODELS, RunningServer, run_server

MODEL = "warmup_probe"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repository = tmp_path_factory.mktemp("warmup_repo")
    shutil.copytree(TEST_MODELS / MODEL, repository / MODEL)
    with run_server(repository, "--model-control-mode", "explicit", "--load-model", MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        yield c


def history(client: Any, protocol: Any = grpcclient) -> list[Any]:
    """What the model's instance executed before this request (one request of 1 float)."""
    tensor = protocol.InferInput("INPUT0", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.array([[0.5]], dtype=np.float32))
    result = client.infer(MODEL, [tensor]).as_numpy("HISTORY")
    executes: list[Any] = json.loads(result[0][0])
    return executes


def config_with(client: grpcclient.InferenceServerClient, warmup: list[Any]) -> str:
    """The model's config with these warmup samples instead of its own (protobuf JSON)."""
    from google.protobuf import json_format

    config = client.get_model_config(MODEL).config
    document = json.loads(json_format.MessageToJson(config, preserving_proto_field_name=True))
    document["model_warmup"] = warmup
    return json.dumps(document)


def sample(name: str, **input_spec: Any) -> dict[str, Any]:
    spec = {"data_type": "TYPE_FP32", "dims": [2], **input_spec}
    return {"name": name, "batch_size": 1, "inputs": {"INPUT0": spec}}


def test_samples_run_before_the_model_is_ready(server: RunningServer) -> None:
    """zeros: 2 requests per execute, 3 times; from_file: the file's first 8 bytes (it has
    12); random: 3 values; the batch_size 0 sample is skipped; then the real request.
    HTTP sees the same history: one instance, warmed once."""
    zeros = [[[0.0] * 4], [[0.0] * 4]]
    for protocol, url in ((grpcclient, server.grpc_url), (httpclient, server.http_url)):
        c = protocol.InferenceServerClient(url)
        executes = history(c, protocol)
        c.close()
        assert executes[:3] == [zeros] * 3
        assert executes[3] == [[[1.5, -2.0]]]
        assert len(executes[4]) == 1 and len(executes[4][0][0]) == 3
        assert all(len(e[0][0]) != 5 for e in executes)  # the skipped sample never ran
        assert executes[5:] == [[[[0.5]]]] * (len(executes) - 5)  # earlier real requests


def test_reload_warms_the_new_instance(client: grpcclient.InferenceServerClient) -> None:
    client.load_model(MODEL)
    executes = history(client)
    assert len(executes) == 5  # 3 + 1 + 1 warmup executes, no real request yet


@pytest.mark.parametrize(
    ("warmup", "reason"),
    [
        ([sample("open", dims=[-1], zero_data=True)],
         "warmup setting expects all variable-size dimensions are specified for input "
         "'INPUT0'"),
        ([sample("long", dims=[16], input_data_file="two_floats.bin")],
         "warmup setting expects 64 bytes, but the data provided from two_floats.bin only has "
         "12 bytes"),
        ([sample("escape", input_data_file="../config.pbtxt")],
         "warmup data file '../config.pbtxt' is outside the model's warmup folder"),
        ([sample("absent", input_data_file="absent.bin")],
         "unable to read warmup data file 'absent.bin'"),
        ([sample("no_data")], "warmup setting expects input 'INPUT0' to have input_data_type set"),
        ([sample("int", data_type="TYPE_INT32", zero_data=True)],
         "warmup sample 'int' is not a valid request: "),
        ([sample("fails", input_data_file="fails.bin")],
         "failed to run warmup sample 'fails': the warmup data asks for an error; "),
    ],
)  # fmt: skip
def test_a_bad_sample_makes_the_model_unavailable(
    client: grpcclient.InferenceServerClient, warmup: list[Any], reason: str
) -> None:
    bad = config_with(client, warmup)
    client.unload_model(MODEL)
    with pytest.raises(InferenceServerException) as raised:
        client.load_model(MODEL, config=bad)
    assert reason in raised.value.message()
    assert not client.is_model_ready(MODEL)
    index = {m.name: m for m in client.get_model_repository_index().models}
    assert index[MODEL].state == "UNAVAILABLE"
    assert reason in index[MODEL].reason
    client.load_model(MODEL)  # its own config again: warmed up and serving
    assert len(history(client)) == 5


def test_a_failed_reload_leaves_the_loaded_model_serving(
    client: grpcclient.InferenceServerClient,
) -> None:
    """As in Triton: the loaded model serves while the new one starts, and stays when the
    new one cannot start (its instance is the one that served before)."""
    client.load_model(MODEL)
    before = history(client)
    with pytest.raises(InferenceServerException) as raised:
        client.load_model(
            MODEL, config=config_with(client, [sample("f", input_data_file="fails.bin")])
        )
    assert "failed to run warmup sample 'f'" in raised.value.message()
    assert client.is_model_ready(MODEL)
    index = {m.name: m for m in client.get_model_repository_index().models}
    assert index[MODEL].state == "READY"
    assert history(client) == [*before, [[[0.5]]]]  # the same instance, warmed once


def test_the_worker_of_a_failed_warmup_is_gone(
    server: RunningServer, client: grpcclient.InferenceServerClient
) -> None:
    """A failed warmup stops the instance it started: no worker process is left."""
    import psutil

    before = {p.pid for p in psutil.Process(server.process.pid).children()}
    failing = config_with(client, [sample("f", input_data_file="fails.bin")])
    with pytest.raises(InferenceServerException):
        client.load_model(MODEL, config=failing)
    after = {p.pid for p in psutil.Process(server.process.pid).children()}
    assert not after - before
    client.load_model(MODEL)
