"""Triton Python-backend models (tests/models, examples) through the real server.

Driven by unmodified tritonclient, over gRPC and HTTP both, against the session's
``test_server`` (tests/models copied to a temporary repository, explicit control
mode, every model loaded at startup) and ``example_server`` (examples/models).
"""

from __future__ import annotations

import json
import queue
import shutil
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException, np_to_triton_dtype, triton_to_np_dtype

from conftest import TEST_MODELS, RunningServer, run_server

DEADLINE_S = 60.0
RNG = np.random.default_rng(11)

# A TritonError code's name -> (gRPC status, HTTP status) the client sees.
STATUS = {
    "UNKNOWN": ("UNKNOWN", "400"),
    "INTERNAL": ("INTERNAL", "500"),
    "NOT_FOUND": ("NOT_FOUND", "404"),
    "INVALID_ARG": ("INVALID_ARGUMENT", "400"),
    "UNAVAILABLE": ("UNAVAILABLE", "503"),
    "UNSUPPORTED": ("UNIMPLEMENTED", "501"),
    "ALREADY_EXISTS": ("ALREADY_EXISTS", "400"),
    "CANCELLED": ("CANCELLED", "400"),
}
TRITON_ERROR_CODES = {
    "UNKNOWN": 0, "INTERNAL": 1, "NOT_FOUND": 2, "INVALID_ARG": 3, "UNAVAILABLE": 4,
    "UNSUPPORTED": 5, "ALREADY_EXISTS": 6, "CANCELLED": 7,
}  # fmt: skip


@dataclass
class Client:
    """One tritonclient (gRPC or HTTP) and the few calls whose shapes differ between them."""

    protocol: str
    lib: Any
    api: Any
    repository: Path  # the server's

    def infer(self, model: str, arrays: dict[str, Any], version: str = "") -> Any:
        inputs = []
        for name, array in arrays.items():
            tensor = self.lib.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        return self.api.infer(model, inputs, model_version=version)

    def fails(self, code: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
        """Call, expect the status of this TritonError code; the error's message."""
        with pytest.raises(InferenceServerException) as info:
            call(*args, **kwargs)
        grpc_status, http_status = STATUS[code]
        expected = f"StatusCode.{grpc_status}" if self.protocol == "grpc" else http_status
        assert str(info.value.status()) == expected, info.value.message()
        return str(info.value.message())

    def model_file(self, model: str) -> str:
        """The path of the server's copy of a test model's model.py (in tracebacks)."""
        return str((self.repository / model / "1" / "model.py").resolve())

    def index(self) -> dict[tuple[str, str], dict[str, str]]:
        """The repository index by (model, version)."""
        if self.protocol == "grpc":
            rows = self.api.get_model_repository_index(as_json=True).get("models", [])
        else:
            rows = self.api.get_model_repository_index()
        return {(row["name"], row.get("version", "")): row for row in rows}

    def config(self, model: str) -> dict[str, Any]:
        if self.protocol == "grpc":
            config: dict[str, Any] = self.api.get_model_config(model, as_json=True)["config"]
            return config
        result: dict[str, Any] = self.api.get_model_config(model)
        return result


def _connect(protocol: str, server: RunningServer) -> Client:
    if protocol == "grpc":
        api: Any = grpcclient.InferenceServerClient(server.grpc_url)
        return Client("grpc", grpcclient, api, server.repository)
    api = httpclient.InferenceServerClient(server.http_url)
    return Client("http", httpclient, api, server.repository)


@pytest.fixture(scope="module", params=["grpc", "http"])
def client(request: pytest.FixtureRequest, test_server: RunningServer) -> Iterator[Client]:
    connected = _connect(request.param, test_server)
    yield connected
    connected.api.close()


@pytest.fixture(scope="module", params=["grpc", "http"])
def examples(request: pytest.FixtureRequest, example_server: RunningServer) -> Iterator[Client]:
    connected = _connect(request.param, example_server)
    yield connected
    connected.api.close()


def fp32(*values: float) -> Any:
    return np.array(values, dtype=np.float32)


def wait_ready(client: Client, model: str) -> None:
    """Poll readiness until the deadline (a restart takes as long as it takes)."""
    deadline = time.monotonic() + DEADLINE_S
    while not client.api.is_model_ready(model):
        assert time.monotonic() < deadline, f"model '{model}' not ready within {DEADLINE_S} s"


# -- failures inside models ----------------------------------------------------------------
def test_execute_raising_fails_the_request_with_its_message(client: Client) -> None:
    message = client.fails("INTERNAL", client.infer, "raises", {"INPUT0": fp32(1)})
    assert message == (  # Triton's words: the instance, the exception, where it was raised
        "Failed to process the request(s) for model 'raises_0_0', message: ValueError: raises: "
        f"execute failed on purpose\n\nAt:\n  {client.model_file('raises')}(6): execute\n"
    )
    assert client.api.is_model_ready("raises")  # the model goes on serving


@pytest.mark.parametrize("code", sorted(TRITON_ERROR_CODES))
def test_triton_error_codes_reach_the_client(client: Client, code: str) -> None:
    number = np.array([TRITON_ERROR_CODES[code]], dtype=np.int32)
    message = client.fails(code, client.infer, "returns_error", {"CODE": number})
    assert f"returns_error: code {TRITON_ERROR_CODES[code]} on purpose" in message


def test_models_that_cannot_load_are_unavailable_with_their_reason(client: Client) -> None:
    index = client.index()
    reasons = {name: index[(name, "")] for name in ("bad_config", "syntax_error", "init_raises")}
    for name, row in reasons.items():
        assert row["state"] == "UNAVAILABLE", row
        assert not client.api.is_model_ready(name)
    assert "bad_config/config.pbtxt" in reasons["bad_config"]["reason"]
    assert reasons["syntax_error"]["reason"] == "SyntaxError: expected ':' (model.py, line 5)"
    assert reasons["init_raises"]["reason"] == (
        "RuntimeError: init_raises: initialize failed on purpose\n\nAt:\n"
        f"  {client.model_file('init_raises')}(9): initialize\n"
    )
    assert index[("plain", "1")]["state"] == "READY"
    message = client.fails("UNAVAILABLE", client.infer, "init_raises", {"INPUT0": fp32(1)})
    assert "init_raises" in message


# -- what models can do ------------------------------------------------------------------------
def test_async_execute(client: Client) -> None:
    result = client.infer("async_execute", {"INPUT0": fp32(1, 2, 3)})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), fp32(2, 3, 4))


def test_auto_complete_config_declares_inputs_and_outputs(client: Client) -> None:
    config = client.config("auto_complete")
    inputs = {i["name"]: (i["data_type"], [int(d) for d in i["dims"]]) for i in config["input"]}
    assert inputs == {"INPUT0": ("TYPE_INT32", [2]), "INPUT1": ("TYPE_STRING", [-1])}
    assert [o["name"] for o in config["output"]] == ["OUTPUT0", "OUTPUT1"]
    assert int(config["max_batch_size"]) == 4
    assert "dynamic_batching" in config
    in0 = np.arange(6, dtype=np.int32).reshape(3, 2)
    in1 = np.array([[b"a", b"b"], [b"c", b""], [b"\x00", b"z"]], dtype=np.object_)
    result = client.infer("auto_complete", {"INPUT0": in0, "INPUT1": in1})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), in0 * 10)
    assert result.as_numpy("OUTPUT1").tolist() == in1.tolist()


def test_optional_input_may_be_left_out(client: Client) -> None:
    both = client.infer("optional_input", {"INPUT0": fp32(1, 2), "INPUT1": fp32(10, 20)})
    np.testing.assert_array_equal(both.as_numpy("OUTPUT0"), fp32(11, 22))
    assert both.as_numpy("OUTPUT1").tolist() == [True]
    alone = client.infer("optional_input", {"INPUT0": fp32(1, 2)})
    np.testing.assert_array_equal(alone.as_numpy("OUTPUT0"), fp32(1, 2))
    assert alone.as_numpy("OUTPUT1").tolist() == [False]
    message = client.fails("INVALID_ARG", client.infer, "optional_input", {"INPUT1": fp32(1)})
    assert "missing required input(s) ['INPUT0']" in message


def test_reshape_gives_the_model_its_shape_and_the_client_its_own(client: Client) -> None:
    values = fp32(1, 2, 3, 4)
    result = client.infer("reshape", {"INPUT0": values})
    assert result.as_numpy("SEEN_SHAPE").tolist() == [2, 2]
    output = result.as_numpy("OUTPUT0")
    assert list(output.shape) == [4]
    np.testing.assert_array_equal(output, values.reshape(2, 2).T.reshape(4))


def test_initialize_gets_tritons_args(client: Client, test_server: RunningServer) -> None:
    result = client.infer("check_args", {"INPUT0": fp32(0)})
    args = json.loads(result.as_numpy("ARGS")[0])
    assert args["model_name"] == "check_args"
    assert args["model_version"] == "1"
    assert args["model_instance_kind"] == "CPU"
    assert args["model_instance_device_id"] == "0"
    assert args["model_instance_name"] in {"check_args_0_0", "check_args_0_1"}
    assert args["model_repository"] == str(test_server.repository / "check_args")
    config = json.loads(args["model_config"])
    assert config["name"] == "check_args"
    assert config["parameters"] == {"custom_key": {"string_value": "custom_value"}}
    assert [group["count"] for group in config["instance_group"]] == [2]


def test_a_kind_model_instance_is_told_so(tmp_path: Path) -> None:
    """KIND_MODEL: the model places itself; initialize hears "MODEL", as Triton says it."""
    shutil.copytree(TEST_MODELS / "check_args", tmp_path / "check_args")
    config = tmp_path / "check_args" / "config.pbtxt"
    config.write_text(config.read_text().replace("kind: KIND_CPU", "kind: KIND_MODEL"))
    with run_server(tmp_path) as server, grpcclient.InferenceServerClient(server.grpc_url) as c:
        tensor = grpcclient.InferInput("INPUT0", [1], "FP32")
        tensor.set_data_from_numpy(fp32(0))
        args = json.loads(c.infer("check_args", [tensor]).as_numpy("ARGS")[0])
    assert args["model_instance_kind"] == "MODEL"
    assert args["model_instance_device_id"] == "0"
    assert args["model_instance_name"] in {"check_args_0_0", "check_args_0_1"}


@pytest.mark.parametrize("count", [16, 1 << 20], ids=["inline", "arena"])
def test_as_numpy_is_a_view_of_the_request(client: Client, count: int) -> None:
    values = RNG.standard_normal(count).astype(np.float32)
    result = client.infer("in_place", {"INPUT0": values})
    assert result.as_numpy("SAME_MEMORY").tolist() == [True]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values + 1)


def test_version_policy_serves_the_chosen_versions(client: Client) -> None:
    index = client.index()
    assert {key for key in index if key[0] == "versioned"} == {
        ("versioned", "1"),
        ("versioned", "3"),
    }
    latest = client.infer("versioned", {"INPUT0": fp32(0)})
    response = latest.get_response()
    version = response["model_version"] if client.protocol == "http" else response.model_version
    assert version == "3"
    assert latest.as_numpy("OUTPUT0").tolist() == [3]
    first = client.infer("versioned", {"INPUT0": fp32(0)}, version="1")
    assert first.as_numpy("OUTPUT0").tolist() == [1]
    message = client.fails("NOT_FOUND", client.infer, "versioned", {"INPUT0": fp32(0)}, "2")
    assert "'versioned' version 2 is not found" in message
    assert client.api.is_model_ready("versioned", "1")
    assert not client.api.is_model_ready("versioned", "2")


# -- custom metrics ----------------------------------------------------------------------------
def scrape(server: RunningServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(server.metrics_url, timeout=DEADLINE_S) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_custom_metrics_reach_the_metrics_endpoint(
    client: Client, test_server: RunningServer
) -> None:
    labels = (("model", "custom_metrics"), ("version", "1"))
    before = scrape(test_server)
    sums = [3.0, 30.0, 300.0]
    counts = []
    for total in sums:
        result = client.infer("custom_metrics", {"INPUT0": fp32(total / 2, total / 2)})
        counts.append(result.as_numpy("OUTPUT0")[0])  # Metric.value(), asked in execute
        refusal = result.as_numpy("OUTPUT1")[0].decode()
        assert "can only be incremented monotonically by non-negative values" in refusal
    assert counts[1:] == [counts[0] + 1, counts[0] + 2]
    after = scrape(test_server)
    # the parser names counter samples <name>_total
    assert after[("test_custom_requests_total", labels)] == counts[-1]
    assert after[("test_custom_last_sum", labels)] == sums[-1]

    def delta(name: str, *extra: tuple[str, str]) -> float:
        key = (name, tuple(sorted(labels + extra)))
        return after[key] - before.get(key, 0.0)

    assert delta("test_custom_sum_count") == 3
    assert delta("test_custom_sum_sum") == sum(sums)
    assert delta("test_custom_sum_bucket", ("le", "10.0")) == 1
    assert delta("test_custom_sum_bucket", ("le", "100.0")) == 2
    assert delta("test_custom_sum_bucket", ("le", "+Inf")) == 3


@pytest.fixture(scope="module")
def debug_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """custom_metrics with two instances, run as threads of the server (--debug)."""
    repository = tmp_path_factory.mktemp("debug_repo")
    shutil.copytree(TEST_MODELS / "custom_metrics", repository / "custom_metrics")
    config = repository / "custom_metrics" / "config.pbtxt"
    text = config.read_text()
    assert "count: 1" in text
    config.write_text(text.replace("count: 1", "count: 2"))
    with run_server(repository, "--debug") as server:
        yield server


def test_in_process_instances_each_use_their_own_link(debug_server: RunningServer) -> None:
    """Concurrent requests keep both threads' value() calls in flight on their own channels."""
    total = 16
    done: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with grpcclient.InferenceServerClient(debug_server.grpc_url) as api:
        for _ in range(total):
            tensor = grpcclient.InferInput("INPUT0", [1], "FP32")
            tensor.set_data_from_numpy(fp32(1))
            api.async_infer(
                "custom_metrics", [tensor], lambda result, error: done.put((result, error))
            )
        results = [done.get(timeout=DEADLINE_S) for _ in range(total)]
    assert [error for _, error in results if error is not None] == []
    counts = sorted(result.as_numpy("OUTPUT0")[0] for result, _ in results)
    assert counts[-1] == total
    labels = (("model", "custom_metrics"), ("version", "1"))
    assert scrape(debug_server)[("test_custom_requests_total", labels)] == total


# -- load and unload at run time (explicit mode) ------------------------------------------------
def test_unload_and_load_a_model(client: Client) -> None:
    assert client.infer("plain", {"INPUT0": fp32(5)}).as_numpy("OUTPUT0").tolist() == [5]
    client.api.unload_model("plain")
    assert not client.api.is_model_ready("plain")
    assert client.index()[("plain", "")]["state"] == "UNAVAILABLE"
    client.fails("UNAVAILABLE", client.infer, "plain", {"INPUT0": fp32(5)})
    client.api.load_model("plain")
    assert client.api.is_model_ready("plain")
    assert client.infer("plain", {"INPUT0": fp32(6)}).as_numpy("OUTPUT0").tolist() == [6]


def test_loading_a_broken_model_says_why(client: Client) -> None:
    with pytest.raises(InferenceServerException) as info:
        client.api.load_model("bad_config")
    assert "bad_config/config.pbtxt" in str(info.value.message())
    assert client.api.is_model_ready("plain")  # the others serve on


def test_reloading_a_model_loses_no_request(client: Client, test_server: RunningServer) -> None:
    """The loaded model serves while its reload starts new instances (Triton's promise: no
    loss of availability): requests sent all along the reload succeed."""
    import threading

    reloaded = threading.Event()

    def reload() -> None:
        other = _connect(client.protocol, test_server)  # a client per thread (HTTP's are not
        try:  # thread-safe)
            other.api.load_model("plain")
        finally:
            other.api.close()
            reloaded.set()

    assert client.infer("plain", {"INPUT0": fp32(3)}).as_numpy("OUTPUT0").tolist() == [3]
    reloader = threading.Thread(target=reload)
    reloader.start()
    results: list[Any] = []
    while not reloaded.is_set():
        try:
            results.append(client.infer("plain", {"INPUT0": fp32(3)}).as_numpy("OUTPUT0").tolist())
        except InferenceServerException as exc:
            results.append(exc.message())
    reloader.join()
    assert results, "no request was sent while the model was being reloaded"
    assert [r for r in results if r != [3]] == []


def test_a_config_asking_for_batch_inputs_is_refused(client: Client) -> None:
    """Ragged batching's batch_input would give the model inputs dlserve does not make."""
    from google.protobuf import json_format

    config = client.api.get_model_config("plain")
    if client.protocol == "grpc":
        config = json_format.MessageToDict(config.config, preserving_proto_field_name=True)
    document = dict(config)
    document["batch_input"] = [{"kind": "BATCH_ELEMENT_COUNT", "target_name": ["COUNT"],
                                "data_type": "TYPE_FP32", "source_input": ["INPUT0"]}]  # fmt: skip
    with pytest.raises(InferenceServerException) as info:
        client.api.load_model("plain", config=json.dumps(document))
    assert "'batch_input' (ragged batching) is not supported by dlserve" in info.value.message()
    assert client.api.is_model_ready("plain")  # the loaded one serves on, as in Triton
    assert client.infer("plain", {"INPUT0": fp32(5)}).as_numpy("OUTPUT0").tolist() == [5]
    client.api.load_model("plain")
    assert client.infer("plain", {"INPUT0": fp32(6)}).as_numpy("OUTPUT0").tolist() == [6]


# -- a worker that dies --------------------------------------------------------------------------
def test_a_dying_worker_fails_its_request_and_comes_back(client: Client) -> None:
    assert client.infer("crash", {"INPUT0": fp32(1)}).as_numpy("OUTPUT0").tolist() == [1]
    message = client.fails("INTERNAL", client.infer, "crash", {"INPUT0": fp32(-1)})
    assert message == "Stub process 'crash_0_0' is not healthy. Its process exited with code 1."
    wait_ready(client, "crash")
    assert client.infer("crash", {"INPUT0": fp32(2)}).as_numpy("OUTPUT0").tolist() == [2]


# -- the example "double" model -------------------------------------------------------------------
def test_double(examples: Client) -> None:
    image = RNG.standard_normal((1, 3, 224, 224)).astype(np.float32)
    result = examples.infer("double", {"INPUT_0": image})
    np.testing.assert_array_equal(result.as_numpy("OUTPUT_0"), image * 2)
    config = examples.config("double")
    assert config["parameters"]["force_gpu_tensors"]["string_value"] == "True"


# -- the example identity models: every data type, bit for bit ------------------------------------
IDENTITY_TYPES = [
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BF16", "BYTES",
]  # fmt: skip


def identity_values(datatype: str, shape: tuple[int, ...]) -> Any:
    if datatype == "BYTES":
        pool = [b"", b"a", b"\x00\xff", "w\u00f6rld".encode(), b"x" * 100]
        flat = [pool[i % len(pool)] for i in range(int(np.prod(shape)))]
        return np.array(flat, dtype=np.object_).reshape(shape)
    if datatype == "BF16":
        return RNG.standard_normal(shape).astype(ml_dtypes.bfloat16)
    if datatype == "BOOL":
        return RNG.integers(0, 2, shape).astype(bool)
    dtype = np.dtype(triton_to_np_dtype(datatype))
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return RNG.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    return RNG.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("datatype", IDENTITY_TYPES)
def test_identity_models(examples: Client, datatype: str) -> None:
    model = f"identity_{datatype.lower()}"
    shapes = [(3, 5), (1, 0)] if datatype == "FP32" else [(7,), (0,)]  # FP32 batches (max 8)
    for shape in shapes:
        sent = identity_values(datatype, shape)
        result = examples.infer(model, {"INPUT0": sent})
        got = result.as_numpy("OUTPUT0")
        assert list(got.shape) == list(shape)
        if datatype == "BYTES":
            assert got.tolist() == sent.tolist()
        else:  # bit for bit: BF16 as its patterns, floats with the signs of their zeros
            assert got.dtype == sent.dtype
            assert got.tobytes() == sent.tobytes()


@pytest.mark.parametrize(
    "flags",
    [("--disable-auto-complete-config",), ("--strict-model-config", "true"),
     ("--strict-model-config",), ("--strict-model-config", "false")],
)  # fmt: skip
def test_auto_complete_can_be_switched_off(tmp_path: Any, flags: tuple[str, ...]) -> None:
    """Without auto-complete the config stays as written (here: none, so no inputs), as in
    Triton; --strict-model-config false keeps it on."""
    shutil.copytree(TEST_MODELS / "auto_complete", tmp_path / "auto_complete")
    completes = flags == ("--strict-model-config", "false")
    with (
        run_server(tmp_path, *flags) as server,
        grpcclient.InferenceServerClient(server.grpc_url) as client,
    ):
        config = client.get_model_config("auto_complete").config
        assert [i.name for i in config.input] == (["INPUT0", "INPUT1"] if completes else [])
        assert config.max_batch_size == (4 if completes else 0)
