"""The HTTP frontend end to end: a real dlserve, the unmodified tritonclient.http, and raw
HTTP (http.client, sockets) for what a well-behaved client never sends."""

from __future__ import annotations

import gzip
import http.client
import json
import shutil
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import EXAMPLES, RunningServer, run_server

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 1 << 20  # --http-max-input-size of the explicit-mode server


# --- fixtures and helpers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(example_server: RunningServer) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(example_server.http_url)
    yield c
    c.close()


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """add_sub in a repository of its own, explicit control mode, a small input limit."""
    repository = tmp_path_factory.mktemp("http_repo")
    shutil.copytree(EXAMPLES / "add_sub", repository / "add_sub")
    extra = ("--model-control-mode", "explicit", "--http-max-input-size", str(LIMIT))
    with run_server(repository, *extra) as server:
        yield server


def raw(
    server: RunningServer,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def error_of(
    server: RunningServer,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> tuple[int, str]:
    status, got, content = raw(server, method, path, body, headers)
    assert got["content-type"] == "application/json"
    return status, json.loads(content)["error"]


def still_serving(server: RunningServer) -> None:
    assert server.alive()
    assert raw(server, "GET", "/v2/health/live")[0] == 200


def add_sub_inputs(a: np.ndarray, b: np.ndarray, binary: bool) -> list[httpclient.InferInput]:
    inputs = []
    for name, value in (("INPUT0", a), ("INPUT1", b)):
        tensor = httpclient.InferInput(name, list(value.shape), "FP32")
        tensor.set_data_from_numpy(value, binary_data=binary)
        inputs.append(tensor)
    return inputs


def json_infer(**header: Any) -> bytes:
    return json.dumps(header).encode()


def fp32_input(name: str, values: list[float], **extra: Any) -> dict[str, Any]:
    return {"name": name, "datatype": "FP32", "shape": [len(values)], "data": values, **extra}


A = np.array([1.0, 2.5, -3.0, 4.0], np.float32)
B = np.array([0.5, 0.5, 1.0, -4.0], np.float32)


# --- health and metadata ----------------------------------------------------------------------


def test_health(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()


def test_server_metadata(client: httpclient.InferenceServerClient) -> None:
    meta = client.get_server_metadata()
    assert meta["name"] == "dlserve"
    assert {"binary_tensor_data", "statistics", "model_repository"} <= set(meta["extensions"])


@pytest.mark.parametrize("version", ["", "1"])
def test_model_metadata_and_config(client: httpclient.InferenceServerClient, version: str) -> None:
    meta = client.get_model_metadata("add_sub", version)
    assert meta["name"] == "add_sub" and meta["versions"] == ["1"]
    assert meta["inputs"] == [
        {"name": "INPUT0", "datatype": "FP32", "shape": [-1]},
        {"name": "INPUT1", "datatype": "FP32", "shape": [-1]},
    ]
    config = client.get_model_config("add_sub", version)
    assert config["name"] == "add_sub"
    assert [i["name"] for i in config["input"]] == ["INPUT0", "INPUT1"]
    assert client.is_model_ready("add_sub", version)


def test_model_ready_for_unknown_model_and_version(example_server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(example_server.http_url)
    assert not client.is_model_ready("no_such_model")
    assert not client.is_model_ready("add_sub", "7")
    assert error_of(example_server, "GET", "/v2/models/nope/ready") == (
        400,
        "Model version not ready",
    )


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("/v2/models/no_such_model", 404, "no_such_model"),
        ("/v2/models/add_sub/versions/7", 404, "version 7"),
        ("/v2/models/no_such_model/config", 404, "no_such_model"),
        ("/v2/nothing/here", 404, "Not Found"),
        # a version in a path is digits, as Triton's routes have it: anything else is no route
        ("/v2/models/add_sub/versions/-1", 404, "Not Found"),
        ("/v2/models/add_sub/versions/latest/config", 404, "Not Found"),
    ],
)
def test_unknown_things_are_not_found(
    example_server: RunningServer, path: str, status: int, message: str
) -> None:
    got_status, error = error_of(example_server, "GET", path)
    assert got_status == status and message in error
    still_serving(example_server)


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v2/models/add_sub/infer", "POST"),
        ("POST", "/v2/health/live", "GET, HEAD"),
        ("DELETE", "/v2/logging", "GET, HEAD, POST"),
        ("PUT", "/v2/models/add_sub/versions/1/generate", "POST"),
        ("TRACE", "/v2/systemsharedmemory/status", "GET, HEAD"),
    ],
)
def test_wrong_method(example_server: RunningServer, method: str, path: str, allowed: str) -> None:
    """405 with Triton's message, and the Allow header RFC 9110 (15.5.6) asks for."""
    status, headers, content = raw(example_server, method, path)
    assert (status, json.loads(content)) == (405, {"error": "Method Not Allowed"})
    assert sorted(headers["allow"].split(", ")) == sorted(allowed.split(", "))


def test_version_minus_one_is_no_route(example_server: RunningServer) -> None:
    """Triton's HTTP routes take digits for a version: -1 does not mean the latest there."""
    a = np.ones(4, np.float32)
    body = json.dumps({"inputs": [
        {"name": name, "shape": [4], "datatype": "FP32", "data": a.tolist()}
        for name in ("INPUT0", "INPUT1")
    ]}).encode()  # fmt: skip
    for path in ("/v2/models/add_sub/versions/-1/infer", "/v2/models/add_sub/versions/x/infer",
                 "/v2/models/add_sub/versions/-1/generate"):  # fmt: skip
        assert error_of(example_server, "POST", path, body) == (404, "Not Found")
    assert raw(example_server, "GET", "/v2/models/add_sub/versions/-1/ready")[0] == 404
    assert raw(example_server, "POST", "/v2/models/add_sub/versions/1/infer", body)[0] == 200


def test_a_version_past_int64_is_refused(example_server: RunningServer) -> None:
    big = "99999999999999999999"
    expected = (
        f"failed to get model version from specified version string '{big}' (details: stol), "
        "version should be an integral value > 0"
    )
    for path in (f"/v2/models/add_sub/versions/{big}", f"/v2/models/add_sub/versions/{big}/ready",
                 f"/v2/models/add_sub/versions/{big}/stats"):  # fmt: skip
        assert error_of(example_server, "GET", path) == (400, expected)
    assert error_of(example_server, "POST", f"/v2/models/add_sub/versions/{big}/infer",
                    b'{"inputs": []}') == (400, expected)  # fmt: skip


@pytest.mark.parametrize("path", ["/v2/models/no_such_model/stats",
                                  "/v2/models/add_sub/versions/7/stats"])  # fmt: skip
def test_statistics_of_an_unknown_model_or_version(example_server: RunningServer,
                                                   path: str) -> None:  # fmt: skip
    expected = {
        "no_such_model": "requested model 'no_such_model' is not available",
        "add_sub": "requested model version is not available for model 'add_sub'",
    }[path.split("/")[3]]
    assert error_of(example_server, "GET", path) == (400, expected)


@pytest.mark.parametrize("path", ["/v2/trace/setting", "/v2/models/add_sub/trace/setting",
                                  "/v2/logging", "/v2/models/add_sub/generate"])  # fmt: skip
def test_a_required_body_is_required(example_server: RunningServer, path: str) -> None:
    """Triton fails to parse an empty body where it needs one; so does dlserve (with 400)."""
    status, message = error_of(example_server, "POST", path)
    assert status == 400 and "request JSON: it is empty" in message


# --- inference ----------------------------------------------------------------------------------


@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False, None])
def test_add_sub(
    client: httpclient.InferenceServerClient, binary_in: bool, binary_out: bool | None
) -> None:
    outputs = None
    if binary_out is not None:
        outputs = [
            httpclient.InferRequestedOutput(n, binary_data=binary_out)
            for n in ("OUTPUT0", "OUTPUT1")
        ]
    result = client.infer(
        "add_sub", add_sub_inputs(A, B, binary_in), outputs=outputs, request_id="req-7"
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)
    response = result.get_response()
    assert response["id"] == "req-7" and response["model_version"] == "1"
    has_data = ["data" in o for o in response["outputs"]]
    assert has_data == [binary_out is False] * 2  # no outputs named: binary_data_output


def test_only_the_requested_output(client: httpclient.InferenceServerClient) -> None:
    outputs = [httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)]
    result = client.infer("add_sub", add_sub_inputs(A, B, True), outputs=outputs, model_version="1")
    assert [o["name"] for o in result.get_response()["outputs"]] == ["OUTPUT1"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)


@pytest.mark.parametrize("request_algorithm", [None, "gzip", "deflate"])
@pytest.mark.parametrize("response_algorithm", [None, "gzip", "deflate"])
def test_compression(
    client: httpclient.InferenceServerClient,
    request_algorithm: str | None,
    response_algorithm: str | None,
) -> None:
    big = np.arange(4096, dtype=np.float32)
    result = client.infer(
        "add_sub",
        add_sub_inputs(big, big, True),
        request_compression_algorithm=request_algorithm,
        response_compression_algorithm=response_algorithm,
    )
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), big * 2)


def test_response_is_compressed_when_asked(example_server: RunningServer) -> None:
    body = json_infer(inputs=[fp32_input("INPUT0", [1.0] * 64), fp32_input("INPUT1", [1.0] * 64)])
    status, headers, content = raw(
        example_server, "POST", "/v2/models/add_sub/infer", body, {"Accept-Encoding": "gzip"}
    )
    assert status == 200 and headers["content-encoding"] == "gzip"
    assert json.loads(gzip.decompress(content))["outputs"][0]["data"] == [2.0] * 64


IDENTITY_TYPES = {
    "bool": ("BOOL", np.array([True, False, True])),
    "uint8": ("UINT8", np.array([0, 7, 255], np.uint8)),
    "uint16": ("UINT16", np.array([0, 65535], np.uint16)),
    "uint32": ("UINT32", np.array([0, 2**32 - 1], np.uint32)),
    "uint64": ("UINT64", np.array([0, 2**64 - 1], np.uint64)),
    "int8": ("INT8", np.array([-128, 0, 127], np.int8)),
    "int16": ("INT16", np.array([-32768, 32767], np.int16)),
    "int32": ("INT32", np.array([-(2**31), 5], np.int32)),
    "int64": ("INT64", np.array([-(2**63), 2**63 - 1], np.int64)),
    "fp16": ("FP16", np.array([0.5, -65504, 3.140625], np.float16)),
    "fp32": ("FP32", np.array([0.1, -2.5, 1e30], np.float32)),
    "fp64": ("FP64", np.array([0.1, -1e300], np.float64)),
    "bf16": ("BF16", np.array([1.5, -2.0, 3.140625], ml_dtypes.bfloat16)),
    "bytes": ("BYTES", np.array([b"abc", b"", "d\u00e9j\u00e0".encode()], np.object_)),
}


def _identity_input(
    client: httpclient.InferenceServerClient,
    model: str,
    value: np.ndarray,
    datatype: str,
    binary: bool,
) -> httpclient.InferInput:
    batched = len(client.get_model_metadata(model)["inputs"][0]["shape"]) == 2
    value = value.reshape(1, -1) if batched else value
    tensor = httpclient.InferInput("INPUT0", list(value.shape), datatype)
    tensor.set_data_from_numpy(value, binary_data=binary)
    return tensor


@pytest.mark.parametrize(
    ("kind", "binary"),
    # tritonclient sends BF16 inputs as binary only: test_bf16_json sends them as JSON
    [(k, b) for k in sorted(IDENTITY_TYPES) for b in (True, False) if (k, b) != ("bf16", False)],
)
def test_identity_round_trip(
    client: httpclient.InferenceServerClient, kind: str, binary: bool
) -> None:
    model = f"identity_{kind}"
    datatype, value = IDENTITY_TYPES[kind]
    tensor = _identity_input(client, model, value, datatype, binary)
    output = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
    result = client.infer(model, [tensor], outputs=[output])
    got = result.as_numpy("OUTPUT0").reshape(-1)
    if datatype == "BYTES" and not binary:  # JSON carries strings: tritonclient gives str
        got = np.array([s.encode() for s in got], np.object_)
    np.testing.assert_array_equal(got, value)
    assert result.get_response()["outputs"][0]["datatype"] == datatype


def test_bf16_json(example_server: RunningServer) -> None:
    """BF16 as JSON numbers, both ways (Triton refuses this; dlserve accepts it)."""
    body = json_infer(
        inputs=[{"name": "INPUT0", "datatype": "BF16", "shape": [3], "data": [1.5, -2.0, 3.14159]}]
    )
    status, _, content = raw(example_server, "POST", "/v2/models/identity_bf16/infer", body)
    assert status == 200, content
    assert json.loads(content)["outputs"][0]["data"] == [1.5, -2.0, 3.140625]


def test_json_data_nested(example_server: RunningServer) -> None:
    """Nested as its shape: accepted; nested otherwise (here 2 x 2 for a shape [1, 4]):
    400 with Triton's message (docs/differences.md)."""
    inputs = [{"name": "INPUT0", "datatype": "FP32", "shape": [2, 2], "data": [[1, 2], [3, 4]]}]
    status, _, content = raw(
        example_server, "POST", "/v2/models/identity_fp32/infer", json_infer(inputs=inputs)
    )
    assert status == 200, content
    assert json.loads(content)["outputs"][0] == {
        "name": "OUTPUT0",
        "datatype": "FP32",
        "shape": [2, 2],
        "data": [1.0, 2.0, 3.0, 4.0],
    }
    inputs[0]["shape"] = [1, 4]
    status, _, content = raw(
        example_server, "POST", "/v2/models/identity_fp32/infer", json_infer(inputs=inputs)
    )
    assert status == 400
    assert json.loads(content) == {
        "error": "Unable to parse 'data': Shape does not match true shape of 'data' field"
    }


# --- statistics, repository, logging, trace, shared memory ---------------------------------------


def test_statistics(client: httpclient.InferenceServerClient) -> None:
    before = client.get_inference_statistics("add_sub")["model_stats"][0]["inference_count"]
    client.infer("add_sub", add_sub_inputs(A, B, True))
    stats = client.get_inference_statistics("add_sub", "1")["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("add_sub", "1")]
    assert stats[0]["inference_count"] == before + 1
    assert stats[0]["inference_stats"]["success"]["count"] >= 1
    every = client.get_inference_statistics()["model_stats"]
    assert "add_sub" in {s["name"] for s in every}


def test_repository_index(
    client: httpclient.InferenceServerClient, example_server: RunningServer
) -> None:
    index = client.get_model_repository_index()
    assert {"name": "add_sub", "version": "1", "state": "READY"} in index
    status, _, content = raw(example_server, "POST", "/v2/repository/index", b'{"ready": true}')
    assert status == 200 and all(row["state"] == "READY" for row in json.loads(content))
    assert error_of(example_server, "POST", "/v2/repository/index", b'{"ready": 1}') == (
        400,
        "Invalid value for 'ready': expected a boolean",
    )


def test_load_and_unload_need_explicit_mode(client: httpclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as info:
        client.load_model("add_sub")
    assert info.value.status() == "503"
    assert "explicit model load / unload is not allowed" in info.value.message()


def test_load_unload_and_load_with_config(explicit_server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(explicit_server.http_url)
    assert client.get_model_repository_index() == [{"name": "add_sub"}]
    assert not client.is_model_ready("add_sub")
    client.load_model("add_sub")
    assert client.is_model_ready("add_sub")
    result = client.infer("add_sub", add_sub_inputs(A, B, True))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
    config = client.get_model_config("add_sub")
    config["parameters"] = {"marker": {"string_value": "over http"}}
    client.load_model("add_sub", config=json.dumps(config))
    assert client.get_model_config("add_sub")["parameters"]["marker"]["string_value"] == "over http"
    client.unload_model("add_sub", unload_dependents=False)
    assert not client.is_model_ready("add_sub")
    with pytest.raises(InferenceServerException):
        client.infer("add_sub", add_sub_inputs(A, B, True))
    client.load_model("add_sub")
    assert client.is_model_ready("add_sub")


PLUS_ONE = b"""
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor(
                "OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy() + 1
            )])
            for r in requests
        ]
"""


def test_load_a_model_from_files(explicit_server: RunningServer) -> None:
    """tritonclient.http's load_model(config=..., files=...): the files travel base64-encoded
    and form the model's folder."""
    config = json.dumps({
        "name": "plus_one", "backend": "python", "max_batch_size": 0,
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
    })  # fmt: skip
    client = httpclient.InferenceServerClient(explicit_server.http_url)
    try:
        client.load_model("plus_one", config=config, files={"file:1/model.py": PLUS_ONE})
        tensor = httpclient.InferInput("INPUT0", [3], "FP32")
        tensor.set_data_from_numpy(np.array([1, 2, 3], dtype=np.float32))
        result = client.infer("plus_one", [tensor])
        assert result.as_numpy("OUTPUT0").tolist() == [2.0, 3.0, 4.0]
        client.unload_model("plus_one")
        assert not client.is_model_ready("plus_one")
    finally:
        client.close()


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b'{"parameters": {"config": 5}}', 400, "Unable to parse 'config'"),
        (b'{"parameters": {"file:1/model.py": "eA=="}}', 400, "must also send its 'config'"),
        (
            b'{"parameters": {"config": "{}", "file:1/model.py": "not base64!"}}',
            400,
            "Unable to parse 'file:1/model.py': expected the file's content as a base64 string",
        ),
        (
            b'{"parameters": {"config": "{}", "file:../model.py": "eA=="}}',
            400,
            "invalid model file 'file:../model.py'",
        ),
        (b'{"parameters": {"config": "{not json"}}', 400, ""),
        (b"{", 400, "failed to parse the load model request JSON"),
        (b'{"parameters": null}', 400, "Unable to parse 'parameters'"),  # Triton refuses it too
    ],
)
def test_bad_load_requests(
    explicit_server: RunningServer, body: bytes, status: int, message: str
) -> None:
    got = error_of(explicit_server, "POST", "/v2/repository/models/add_sub/load", body)
    assert got[0] == status and message in got[1]
    still_serving(explicit_server)


def test_log_settings(
    client: httpclient.InferenceServerClient, example_server: RunningServer
) -> None:
    settings = client.get_log_settings()
    assert {
        "log_file",
        "log_info",
        "log_warning",
        "log_error",
        "log_verbose_level",
        "log_format",
    } <= set(settings)
    updated = client.update_log_settings({"log_verbose_level": 1, "log_info": None})
    assert updated["log_verbose_level"] == 1 and updated["log_info"] == settings["log_info"]
    assert client.get_log_settings()["log_verbose_level"] == 1
    client.update_log_settings({"log_verbose_level": settings["log_verbose_level"]})
    assert error_of(example_server, "POST", "/v2/logging", b'{"log_file": "/tmp/x"}')[0] == 501
    assert error_of(example_server, "POST", "/v2/logging", b'{"log_info": "yes"}')[0] == 400
    assert error_of(example_server, "POST", "/v2/logging", b'{"log_format": "xml"}')[0] == 400
    big = b'{"log_verbose_level": 2147483648}'  # past gRPC's uint32 setting, as over gRPC
    assert error_of(example_server, "POST", "/v2/logging", big)[0] == 400
    # 2.0 is an integer in JSON; a key that is no setting is ignored, as Triton ignores it
    updated = client.update_log_settings({"log_verbose_level": 2.0, "log_nope": 1})
    assert updated["log_verbose_level"] == 2 and "log_nope" not in updated
    client.update_log_settings({"log_verbose_level": settings["log_verbose_level"]})


def test_trace_settings(
    client: httpclient.InferenceServerClient, example_server: RunningServer
) -> None:
    assert client.get_trace_settings()["trace_level"] == ["OFF"]
    updated = client.update_trace_settings(settings={"trace_rate": "7"})
    assert updated["trace_rate"] == "7"
    model = client.update_trace_settings("add_sub", {"trace_level": ["TIMESTAMPS"]})
    assert model["trace_level"] == ["TIMESTAMPS"] and model["trace_rate"] == "7"
    assert client.get_trace_settings()["trace_level"] == ["OFF"]
    cleared = client.update_trace_settings("add_sub", {"trace_level": None})
    assert cleared["trace_level"] == ["OFF"]
    client.update_trace_settings(settings={"trace_rate": None})
    assert client.get_trace_settings()["trace_rate"] == "1000"
    assert error_of(example_server, "POST", "/v2/trace/setting", b'{"trace_file": "x"}')[0] == 501
    assert (
        error_of(example_server, "POST", "/v2/trace/setting", b'{"trace_level": ["LOUD"]}')[0]
        == 400
    )
    assert error_of(example_server, "GET", "/v2/models/nope/trace/setting")[0] == 400
    for bad in (b'{"trace_rate": 5}', b'{"trace_level": "TIMESTAMPS"}'):  # typed as Triton reads
        assert error_of(example_server, "POST", "/v2/trace/setting", bad)[0] == 400
    assert client.update_trace_settings(settings={"not_a_setting": {}})["trace_rate"] == "1000"


def test_openapi_document(example_server: RunningServer) -> None:
    status, _, content = raw(example_server, "GET", "/v2/openapi.json")
    assert status == 200
    document = json.loads(content)
    assert document == json.loads((ROOT / "docs" / "openapi.json").read_text())
    for path in (
        "/v2/health/live",
        "/v2/models/{model}/infer",
        "/v2/repository/index",
        "/v2/logging",
        "/v2/trace/setting",
        "/v2/models/stats",
    ):
        assert path in document["paths"]


# --- errors: the request fails, the server goes on -----------------------------------------------

INFER = "/v2/models/add_sub/infer"


def test_malformed_json(example_server: RunningServer) -> None:
    status, message = error_of(example_server, "POST", INFER, b'{"inputs": [')
    assert status == 400 and message.startswith("failed to parse the request JSON buffer")
    still_serving(example_server)


def test_binary_body_shorter_than_its_header_says(example_server: RunningServer) -> None:
    header = json_infer(
        inputs=[
            {
                "name": "INPUT0",
                "datatype": "FP32",
                "shape": [4],
                "parameters": {"binary_data_size": 16},
            },
            {
                "name": "INPUT1",
                "datatype": "FP32",
                "shape": [4],
                "parameters": {"binary_data_size": 16},
            },
        ]
    )
    body = header + A.tobytes() + B.tobytes()[:10]
    status, message = error_of(
        example_server, "POST", INFER, body, {"Inference-Header-Content-Length": str(len(header))}
    )
    assert status == 400
    assert (
        message
        == "unexpected size for input 'INPUT1', expecting 6 additional bytes for model 'add_sub'"
    )
    still_serving(example_server)


@pytest.mark.parametrize(
    ("blob", "shape"),
    [
        (struct.pack("<I", 10) + b"abc", [1]),  # an element runs past the end
        (struct.pack("<I", 1) + b"a" + b"\x02\x00", [2]),  # an incomplete length
        (struct.pack("<I", 1) + b"a", [2]),  # fewer elements than the shape
        (struct.pack("<I", 1) + b"a" + struct.pack("<I", 1) + b"b", [1]),  # more
    ],
)
def test_bytes_whose_length_prefixes_lie(
    example_server: RunningServer, blob: bytes, shape: list[int]
) -> None:
    """Binary BYTES data whose length prefixes do not match its size or its shape: 400."""
    parameters = {"binary_data_size": len(blob)}
    header = json_infer(
        inputs=[{"name": "INPUT0", "datatype": "BYTES", "shape": shape, "parameters": parameters}]
    )
    status, message = error_of(
        example_server, "POST", "/v2/models/identity_bytes/infer", header + blob,
        {"Inference-Header-Content-Length": str(len(header))},
    )  # fmt: skip
    assert status == 400, message
    assert message
    still_serving(example_server)


def test_inference_header_longer_than_the_body(example_server: RunningServer) -> None:
    body = json_infer(inputs=[fp32_input("INPUT0", [1.0]), fp32_input("INPUT1", [1.0])])
    status, message = error_of(
        example_server, "POST", INFER, body, {"Inference-Header-Content-Length": str(len(body) + 1)}
    )
    assert (status, message) == (
        400,
        f"inference header size should be in range (0, {len(body)}), got: {len(body) + 1}",
    )
    still_serving(example_server)


def test_unknown_content_encoding(example_server: RunningServer) -> None:
    assert error_of(example_server, "POST", INFER, b"xx", {"Content-Encoding": "br"}) == (
        501,
        "Unsupported compression type",
    )
    status, message = error_of(example_server, "POST", INFER, b"xx", {"Content-Encoding": "gzip"})
    assert status == 400 and "failed to decompress" in message


@pytest.mark.parametrize(
    ("path", "inputs", "status", "message"),
    [
        ("/v2/models/nope/infer", None, 404, "Request for unknown model: 'nope'"),
        ("/v2/models/add_sub/versions/9/infer", None, 404, "version 9"),
        (
            INFER,
            [fp32_input("INPUT0", [1.0]), fp32_input("INPUT9", [1.0])],
            400,
            "unexpected inference input 'INPUT9'",
        ),
        (
            INFER,
            [
                fp32_input("INPUT0", [1.0]),
                {"name": "INPUT1", "datatype": "INT32", "shape": [1], "data": [1]},
            ],
            400,
            "inference input 'INPUT1' data-type is 'INT32', but model 'add_sub' expects 'FP32'",
        ),
        (
            INFER,
            [
                fp32_input("INPUT0", [1.0, 2.0, 3.0, 4.0]) | {"shape": [2, 2]},
                fp32_input("INPUT1", [1.0, 2.0, 3.0, 4.0]) | {"shape": [2, 2]},
            ],
            400,
            "unexpected shape for input 'INPUT0'",
        ),
        (INFER, [fp32_input("INPUT0", [1.0])], 400, "missing required input(s) ['INPUT1']"),
        (
            INFER,
            [fp32_input("INPUT0", [1.0, 2.0]) | {"shape": [3]}, fp32_input("INPUT1", [1.0])],
            400,
            "Shape does not match true shape of 'data' field",
        ),
    ],
)
def test_bad_infer_requests(
    example_server: RunningServer,
    path: str,
    inputs: list[dict[str, Any]] | None,
    status: int,
    message: str,
) -> None:
    body = json_infer(inputs=inputs or [fp32_input("INPUT0", [1.0]), fp32_input("INPUT1", [1.0])])
    got_status, got = error_of(example_server, "POST", path, body)
    assert got_status == status and message in got
    still_serving(example_server)


def test_bad_infer_through_tritonclient(client: httpclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as info:
        client.infer("no_such_model", add_sub_inputs(A, B, True))
    assert info.value.status() == "404"
    assert "no_such_model" in info.value.message()
    assert client.is_server_live()


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    response = http.client.HTTPResponse(sock)
    response.begin()
    return response.status, response.read()


def test_oversize_body_is_refused_by_its_content_length(explicit_server: RunningServer) -> None:
    """A 2 GiB body is answered after its first bytes: the server does not wait to read it."""
    claimed = 2 * 1024**3
    with socket.create_connection(("127.0.0.1", explicit_server.http_port), timeout=30) as sock:
        sock.sendall(
            b"POST /v2/models/add_sub/infer HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\n"
            b'Content-Length: %d\r\n\r\n{"inputs": [' % claimed
        )
        status, body = _read_response(sock)  # times out (fails) if the server waits
    assert status == 400
    assert json.loads(body)["error"].startswith(
        f"request JSON size of {claimed} bytes exceeds the maximum allowed input size of "
        f"{LIMIT} bytes"
    )
    still_serving(explicit_server)


def test_oversize_chunked_body_is_refused_while_streaming(explicit_server: RunningServer) -> None:
    chunk = b"x" * 65536
    with socket.create_connection(("127.0.0.1", explicit_server.http_port), timeout=30) as sock:
        sock.sendall(
            b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for _ in range(LIMIT // len(chunk) + 1):  # one chunk past the limit, then stop sending
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, body = _read_response(sock)
    assert status == 400
    assert "exceeds the maximum allowed input size of" in json.loads(body)["error"]
    still_serving(explicit_server)


def test_oversize_body_from_tritonclient_gets_the_message(explicit_server: RunningServer) -> None:
    """The client sends all of its body before it reads: it must read the 400, not a reset."""
    client = httpclient.InferenceServerClient(explicit_server.http_url)
    big = np.ones(LIMIT // 4, np.float32)  # two inputs: twice the limit
    with pytest.raises(InferenceServerException) as info:
        client.infer("add_sub", add_sub_inputs(big, big, True))
    assert info.value.status() == "400"
    assert info.value.message().startswith("request JSON size of")
    still_serving(explicit_server)


def test_body_within_the_limit_is_served(explicit_server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(explicit_server.http_url)
    client.load_model("add_sub")
    big = np.ones(LIMIT // 16, np.float32)  # two inputs: half the limit
    result = client.infer("add_sub", add_sub_inputs(big, big, True))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), big * 2)


# --- errors raised by models, with their codes (tests/models) ---------------------------------


@pytest.mark.parametrize(
    ("code", "status"),
    [(0, 400), (1, 500), (2, 404), (3, 400), (4, 503), (5, 501), (6, 400), (7, 400)],
)
def test_model_error_codes_become_tritons_statuses(
    test_server: RunningServer, code: int, status: int
) -> None:
    body = json_infer(inputs=[{"name": "CODE", "datatype": "INT32", "shape": [1], "data": [code]}])
    got = error_of(test_server, "POST", "/v2/models/returns_error/infer", body)
    assert got == (status, f"returns_error: code {code} on purpose")
    still_serving(test_server)


def test_model_that_raises(test_server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(test_server.http_url)
    tensor = httpclient.InferInput("INPUT0", [2], "FP32")
    tensor.set_data_from_numpy(np.ones(2, np.float32))
    with pytest.raises(InferenceServerException) as info:
        client.infer("raises", [tensor])
    assert info.value.status() == "500"
    assert "raises: execute failed on purpose" in info.value.message()
    still_serving(test_server)


@pytest.mark.parametrize("version", ["1", "3"])
def test_versioned_routes(test_server: RunningServer, version: str) -> None:
    """tests/models/versioned serves versions 1 and 3 of 1, 2, 3 (a specific policy)."""
    client = httpclient.InferenceServerClient(test_server.http_url)
    assert client.is_model_ready("versioned", version)
    assert client.get_model_metadata("versioned", version)["versions"] == ["1", "3"]
    stats = client.get_inference_statistics("versioned", version)["model_stats"]
    assert [s["version"] for s in stats] == [version]


def test_version_not_served(test_server: RunningServer) -> None:
    client = httpclient.InferenceServerClient(test_server.http_url)
    assert not client.is_model_ready("versioned", "2")
    status, message = error_of(test_server, "GET", "/v2/models/versioned/versions/2")
    assert status == 404 and "version 2" in message


# --- raw binary requests (Inference-Header-Content-Length: 0) ---------------------------------


RAW = {"Inference-Header-Content-Length": "0"}


def _raw_infer(server: RunningServer, model: str, body: bytes) -> tuple[dict[str, Any], bytes]:
    """A raw binary request that succeeds: the response's JSON header and binary data."""
    status, headers, content = raw(server, "POST", f"/v2/models/{model}/infer", body, RAW)
    assert status == 200, content
    length = int(headers["inference-header-content-length"])
    return json.loads(content[:length]), content[length:]


def test_raw_binary_request(example_server: RunningServer) -> None:
    """The body is the one input's data; its shape comes from the config (a batch of 1,
    the -1 from the size); outputs come back as binary data."""
    data = np.arange(8, dtype=np.float32).tobytes()
    header, blob = _raw_infer(example_server, "identity_fp32", data)
    (output,) = header["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == ("OUTPUT0", "FP32", [1, 8])
    assert output["parameters"]["binary_data_size"] == len(data)
    assert blob == data


@pytest.fixture(scope="module")
def raw_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """identity models whose configs a raw request can and cannot be deduced from."""
    repository = tmp_path_factory.mktemp("raw_repo")
    variants = {
        "bytes_one": ("identity_bytes", "dims: [ -1 ]", "dims: [ 1 ]"),
        "fp32_two_variable": ("identity_fp32", "dims: [ -1 ]", "dims: [ -1, -1 ]"),
    }
    for name, (source, old, new) in variants.items():
        shutil.copytree(EXAMPLES / source, repository / name)
        config = repository / name / "config.pbtxt"
        text = config.read_text().replace(f'name: "{source}"', f'name: "{name}"')
        config.write_text(text.replace(old, new))
    with run_server(repository) as server:
        yield server


def test_raw_binary_bytes_input_is_one_element(raw_server: RunningServer) -> None:
    header, blob = _raw_infer(raw_server, "bytes_one", b"427 as it came")
    assert header["outputs"][0]["shape"] == [1]
    assert blob == len(b"427 as it came").to_bytes(4, "little") + b"427 as it came"


@pytest.mark.parametrize(
    ("model", "body", "message"),
    [
        ("add_sub", bytes(64),
         "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in "
         "'add_sub' model configuration"),
        ("identity_bytes", b"abc",
         "For BYTE datatype raw input 'INPUT0', the model must have input shape [1]"),
        ("identity_fp32", bytes(10),
         "input byte size mismatch for input 'INPUT0' for model 'identity_fp32'. "
         "Expected 8, got 10"),
    ],
)  # fmt: skip
def test_raw_binary_request_that_cannot_be_deduced(
    example_server: RunningServer, model: str, body: bytes, message: str
) -> None:
    status, got = error_of(example_server, "POST", f"/v2/models/{model}/infer", body, RAW)
    assert status == 400
    assert message in got
    still_serving(example_server)


def test_raw_binary_request_with_two_variable_dims(raw_server: RunningServer) -> None:
    status, got = error_of(raw_server, "POST", "/v2/models/fp32_two_variable/infer", bytes(16), RAW)
    assert (status, got) == (
        400,
        "The shape of the raw input 'INPUT0' can not be deduced because there are more than "
        "one variable-sized dimension",
    )
