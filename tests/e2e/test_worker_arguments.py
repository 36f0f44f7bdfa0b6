"""pb_utils' C++-string arguments inside a real worker (tests/models/pb_arguments), where
what they do needs the server: a BLS call, model control, custom metrics, an output's
name, an error's message. Each is given as ``str``, as ``bytes`` (Triton's C++ strings
take both) and as a number (pybind11's TypeError, raised at the model's call). The same
arguments' checks on pb_utils alone are in tests/pb_utils/test_pb_arguments.py.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import TEST_MODELS, RunningServer, repository_of, run_server

X = np.array([1.5, -2.0], dtype=np.float32)
PLAIN_CONFIG = (
    '{"backend": "python", "max_batch_size": 0, "input": [{"name": "INPUT0", "data_type": '
    '"TYPE_FP32", "dims": [-1]}], "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", '
    '"dims": [-1]}]}'
)
# case: (the argument's text, what the call returns with it, as the model writes it)
CASES = {
    "InferenceRequest(model_name).exec": ("double", repr((X * 2).tolist())),
    "InferenceRequest(model_name).async_exec": ("double", repr((X * 2).tolist())),
    "InferenceRequest(requested_output_names).exec": ("OUTPUT0", repr((X * 2).tolist())),
    "InferenceRequest(request_id).exec": ("call-1", repr((X * 2).tolist())),
    "is_model_ready(model_name)": ("double", "True"),
    "is_model_ready(model_version)": ("1", "True"),
    "load_model(model_name)": ("plain", "(None, True)"),
    "load_model(config)": (PLAIN_CONFIG, "(None, True)"),
    "unload_model(model_name)": ("plain", "(False, True)"),
    "MetricFamily(name)": ("pb_arguments_named", "2.0"),
    "MetricFamily(description)": ("described", "2.0"),
    "Tensor(name)": ("OUTPUT0", "'OUTPUT0'"),
    "Tensor.from_dlpack(name)": ("OUTPUT0", "'OUTPUT0'"),
    "get_output_buffer(name)": ("OUTPUT0", "'OUTPUT0'"),
    "Logger.log_info(message)": ("logged from a model", "None"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    models = (TEST_MODELS / name for name in ("pb_arguments", "double", "plain"))
    repository = repository_of(tmp_path_factory.mktemp("arguments_repo"), *models)
    options = ("--model-control-mode", "explicit", "--load-model", "*")
    with run_server(repository, *options) as running:
        yield running


@pytest.fixture
def client(server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(server.grpc_url) as triton:
        yield triton


def call(
    client: grpcclient.InferenceServerClient, case: str, kind: str, value: str
) -> grpcclient.InferResult:
    x = grpcclient.InferInput("INPUT0", [len(X)], "FP32")
    x.set_data_from_numpy(X)
    given = grpcclient.InferInput("VALUE", [1], "BYTES")
    given.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
    params = {"case": case, "kind": kind}
    return client.infer("pb_arguments", [x, given], parameters=params)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", ["str", "bytes"])
def test_a_c_string_argument_given_str_or_bytes(
    client: grpcclient.InferenceServerClient, case: str, kind: str
) -> None:
    value, returned = CASES[case]
    result = call(client, case, kind, value)
    assert result.as_numpy("RESULT")[0].decode() == f"ok: {returned}"
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), X)


@pytest.mark.parametrize("case", [*CASES, "TritonError(message)"])
def test_a_c_string_argument_of_a_wrong_type_is_a_type_error_at_the_call(
    client: grpcclient.InferenceServerClient, case: str
) -> None:
    result = call(client, case, "wrong", "unused")
    text = result.as_numpy("RESULT")[0].decode()
    assert text.startswith("TypeError: "), text
    assert "(): incompatible function arguments" in text or "(): incompatible constructor" in text


@pytest.mark.parametrize("kind", ["str", "bytes"])
def test_an_error_message_given_as_bytes_reaches_the_client(
    client: grpcclient.InferenceServerClient, kind: str
) -> None:
    with pytest.raises(InferenceServerException) as raised:
        call(client, "TritonError(message)", kind, "went wrong")
    assert raised.value.message() == "went wrong"


def test_metric_families_named_by_bytes_are_on_the_metrics_endpoint(
    server: RunningServer, client: grpcclient.InferenceServerClient
) -> None:
    call(client, "MetricFamily(name)", "bytes", "pb_arguments_by_bytes")
    with urllib.request.urlopen(server.metrics_url, timeout=60) as response:
        text = response.read().decode()
    assert 'pb_arguments_by_bytes{case="argument"} 2' in text


AUTO_COMPLETE_BYTES = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": b"INPUT0", "data_type": "TYPE_FP32", "dims": [-1]})
        return config

    def execute(self, requests):
        return []
"""


def test_an_auto_completed_config_with_bytes_fails_its_load_as_in_triton(
    server: RunningServer, client: grpcclient.InferenceServerClient
) -> None:
    """ModelConfig is Python in Triton too: a bytes name is kept, and the stub's
    ``json.dumps`` of the config fails the load with its TypeError; the worker does not
    send a config the server cannot read."""
    folder = server.repository / "auto_complete_bytes"
    (folder / "1").mkdir(parents=True)
    (folder / "config.pbtxt").write_text('backend: "python"\n')
    (folder / "1" / "model.py").write_text(AUTO_COMPLETE_BYTES)
    with pytest.raises(InferenceServerException) as raised:
        client.load_model("auto_complete_bytes")
    assert "TypeError: Object of type bytes is not JSON serializable" in raised.value.message()
    assert client.is_model_ready("double")
