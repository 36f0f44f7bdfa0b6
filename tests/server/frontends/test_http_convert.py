"""The HTTP frontend's pure pieces: JSON/binary bodies <-> core types, bytes in and out."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import struct
import time
import tracemalloc
import zlib
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from tritonclient.http import InferResult

from conftest import ROOT
from dlserve import errors
from dlserve.errors import ErrorCode
from dlserve.server.frontends.http import app, bodies, convert
from dlserve.server.frontends.http.status_codes import HTTP_STATUS, error_body, error_reply
from dlserve.types import (
    BatchStats,
    DurationStat,
    InferenceStats,
    InferResponse,
    ModelMetadata,
    ModelState,
    ModelStatistics,
    OutputTensor,
    RegionRef,
    RepositoryEntry,
    ServerMetadata,
    TensorMetadata,
)

# --- error table ----------------------------------------------------------------------------


def test_every_error_code_has_an_http_status() -> None:
    assert set(HTTP_STATUS) == set(ErrorCode)


def test_statuses_are_tritons() -> None:
    assert HTTP_STATUS[ErrorCode.INTERNAL] == 500
    assert HTTP_STATUS[ErrorCode.NOT_FOUND] == 404
    assert HTTP_STATUS[ErrorCode.INVALID_ARG] == 400
    assert HTTP_STATUS[ErrorCode.UNAVAILABLE] == 503
    assert HTTP_STATUS[ErrorCode.UNSUPPORTED] == 501
    assert HTTP_STATUS[ErrorCode.ALREADY_EXISTS] == 400
    assert HTTP_STATUS[ErrorCode.CANCELLED] == 400
    assert HTTP_STATUS[ErrorCode.UNKNOWN] == 400


def test_error_reply_is_triton_json() -> None:
    status, body = error_reply(errors.NotFoundError('no model "m"'))
    assert status == 404
    assert json.loads(body) == {"error": 'no model "m"'}
    assert json.loads(error_body("x")) == {"error": "x"}
    assert error_reply(errors.ModelError("boom", ErrorCode.UNAVAILABLE))[0] == 503


# --- requests -------------------------------------------------------------------------------


def _body(header: dict[str, Any], *blobs: bytes) -> tuple[bytes, int]:
    head = json.dumps(header).encode()
    return head + b"".join(blobs), len(head)


def _parse(header: dict[str, Any], *blobs: bytes) -> Any:
    body, length = _body(header, *blobs)
    return convert.parse_infer_request(body, length, "m", "")


def _tensor(name: str, datatype: str, shape: list[int], **extra: Any) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape, **extra}


def test_json_data_nested_and_flat_give_the_same_bytes() -> None:
    nested = _tensor("A", "FP32", [2, 2], data=[[1, 2], [3, 4.5]])
    flat = _tensor("A", "FP32", [2, 2], data=[1, 2, 3, 4.5])
    for item in (nested, flat):
        request, _ = _parse({"inputs": [item]})
        tensor = request.inputs[0]
        assert tensor.shape == (2, 2)
        assert bytes(tensor.data) == np.array([1, 2, 3, 4.5], np.float32).tobytes()


@pytest.mark.parametrize(
    ("datatype", "values", "numpy_type"),
    [
        ("BOOL", [True, False, True], np.bool_),
        ("UINT8", [0, 255, 7], np.uint8),
        ("INT8", [-128, 127, 0], np.int8),
        ("INT16", [-3, 300, 0], np.int16),
        ("UINT32", [0, 2**32 - 1, 5], np.uint32),
        ("INT64", [-(2**63), 2**63 - 1, 0], np.int64),
        ("UINT64", [0, 2**64 - 1, 1], np.uint64),
        ("FP16", [0.5, -2, 65504], np.float16),
        ("FP64", [0.1, 1e300, -3], np.float64),
    ],
)
def test_json_data_of_each_type(datatype: str, values: list[Any], numpy_type: Any) -> None:
    request, _ = _parse({"inputs": [_tensor("A", datatype, [3], data=values)]})
    assert bytes(request.inputs[0].data) == np.array(values, numpy_type).tobytes()


@pytest.mark.parametrize(("datatype", "numpy_type"), [("FP16", np.float16), ("FP32", np.float32)])
def test_json_numbers_past_a_float_types_range_are_infinite(datatype: str, numpy_type: Any) -> None:
    """As Triton casts them (a double to a float), without a warning: one was found by the
    fuzzer, with warnings as errors."""
    request, _ = _parse({"inputs": [_tensor("A", datatype, [2], data=[1e300, -1e300])]})
    values = np.frombuffer(bytes(request.inputs[0].data), numpy_type)
    assert values.tolist() == [np.inf, -np.inf]


def test_bf16_from_json_numbers_rounds_like_ml_dtypes() -> None:
    values = [1.0, 3.14159, -2.5e-3, 1e38, 0.0, 1.00390625]  # the last is a tie: rounds to even
    request, _ = _parse({"inputs": [_tensor("A", "BF16", [6], data=values)]})
    expected = np.array(values, np.float32).astype(ml_dtypes.bfloat16).tobytes()
    assert bytes(request.inputs[0].data) == expected


def test_bf16_nan_stays_nan() -> None:
    bits = convert.float32_to_bf16(np.array([np.nan, np.inf], np.float32))
    back = convert.bf16_to_float32(bits)
    assert np.isnan(back[0]) and back[1] == np.inf


def test_bytes_from_json_strings() -> None:
    request, _ = _parse({"inputs": [_tensor("S", "BYTES", [2, 1], data=[["ab"], ["\u00e9"]])]})
    raw = "\u00e9".encode()
    expected = struct.pack("<I", 2) + b"ab" + struct.pack("<I", len(raw)) + raw
    assert bytes(request.inputs[0].data) == expected


def test_bytes_nested_as_the_shape_in_order() -> None:
    request, _ = _parse({"inputs": [_tensor("S", "BYTES", [2, 2], data=[["a", "b"], ["c", "d"]])]})
    assert bytes(request.inputs[0].data) == b"".join(
        struct.pack("<I", 1) + c for c in (b"a", b"b", b"c", b"d")
    )


def test_bytes_nested_thousands_deep_is_refused_without_recursion() -> None:
    data: list[Any] = ["z"]
    for _ in range(3000):
        data = [data]
    with pytest.raises(errors.InvalidArgumentError, match=SHAPE):
        convert.json_to_tensor_bytes("S", "BYTES", (1,), data)


# Triton's message (http_server.cc) for JSON data that its shape does not describe
SHAPE = re.escape(convert.SHAPE_MISMATCH)


@pytest.mark.parametrize("datatype", ["INT32", "FP32", "BOOL", "BYTES"])
@pytest.mark.parametrize(
    ("shape", "data"),
    [
        ([4], [[1, 2], [3, 4]]),  # nested deeper than the shape
        ([2, 2], [[[1], [2]], [[3], [4]]]),  # deeper still
        ([2, 2, 1], [[1, 2], [3, 4]]),  # shallower than the shape (and not flat)
        ([2, 2], [[1, 2], [3]]),  # ragged
        ([2, 2], [[1, 2, 3], [4]]),  # ragged, the right count
        ([2, 2], [1, 2, 3]),  # too few
        ([2, 2], [1, 2, 3, 4, 5]),  # too many
        ([2, 2], [[1, 2], [3, 4], [5, 6]]),  # one row too many
        ([2], [1, [2]]),  # a list among scalars
        ([], [[1]]),  # a scalar tensor nested
    ],
)
def test_data_that_does_not_match_its_shape(datatype: str, shape: list[int], data: Any) -> None:
    if datatype == "BYTES":
        data = json.loads(json.dumps(data).replace("1", '"a"').replace("2", '"b"')
                          .replace("3", '"c"').replace("4", '"d"').replace("5", '"e"')
                          .replace("6", '"f"'))  # fmt: skip
    elif datatype == "BOOL":
        data = json.loads(json.dumps(data).replace("1", "true").replace("2", "false")
                          .replace("3", "true").replace("4", "false").replace("5", "true")
                          .replace("6", "false"))  # fmt: skip
    with pytest.raises(errors.InvalidArgumentError, match=f"^{SHAPE}$"):
        _parse({"inputs": [_tensor("X", datatype, shape, data=data)]})


@pytest.mark.parametrize(
    ("shape", "data"),
    [([2, 2], [1, 2, 3, 4]), ([2, 2], [[1, 2], [3, 4]]), ([1, 2, 1], [[[1], [2]]]),
     ([], [7]), ([0], []), ([2, 0], [[], []]), ([2, 0], [])],
)  # fmt: skip
def test_data_flat_or_nested_as_its_shape(shape: list[int], data: Any) -> None:
    request, _ = _parse({"inputs": [_tensor("X", "INT32", shape, data=data)]})
    assert bytes(request.inputs[0].data) == np.asarray(data, "<i4").tobytes()


def test_json_nested_past_the_recursion_limit() -> None:
    """Refused as a bad request, by the JSON parser or (where its depth limit is
    higher, as with msgspec on Python 3.12) by the data conversion."""
    data = b"[" * 5000 + b"1" + b"]" * 5000
    body = b'{"inputs": [{"name": "A", "datatype": "FP32", "shape": [1], "data": ' + data + b"}]}"
    expected = "failed to parse the request JSON|Unable to parse 'data' of input 'A'"
    with pytest.raises(errors.InvalidArgumentError, match=expected):
        convert.parse_infer_request(body, len(body), "m", "")


def test_binary_inputs_are_slices_of_the_body_in_order() -> None:
    a = np.arange(4, dtype=np.float32).tobytes()
    b = np.arange(3, dtype=np.int32).tobytes()
    header = {
        "id": "r1",
        "inputs": [
            _tensor("A", "FP32", [4], parameters={"binary_data_size": len(a)}),
            _tensor("B", "INT32", [3], parameters={"binary_data_size": len(b)}),
        ],
    }
    request, _ = _parse(header, a, b)
    assert request.id == "r1"
    assert [bytes(t.data) for t in request.inputs] == [a, b]
    assert all(isinstance(t.data, memoryview) for t in request.inputs)
    assert request.inputs[0].parameters == {}


def test_binary_body_shorter_than_its_header_says() -> None:
    header = {"inputs": [_tensor("A", "FP32", [4], parameters={"binary_data_size": 16})]}
    with pytest.raises(errors.InvalidArgumentError, match="expecting 4 additional bytes"):
        _parse(header, b"\0" * 12)


def test_binary_body_longer_than_its_header_says() -> None:
    header = {"inputs": [_tensor("A", "FP32", [1], parameters={"binary_data_size": 4})]}
    with pytest.raises(errors.InvalidArgumentError, match="unexpected additional input data"):
        _parse(header, b"\0" * 8)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "failed to parse the request JSON buffer"),
        (b"", "failed to parse the request JSON buffer"),
        (b"[1, 2]", "failed to parse the request JSON buffer: Expected `object`"),
        (b'{"id": "x"}', "missing required field `inputs`"),
        (b'{"inputs": [{"name": 1}]}', "Expected `str`, got `int`"),
    ],
)
def test_malformed_json(body: bytes, message: str) -> None:
    with pytest.raises(errors.InvalidArgumentError, match=message):
        convert.parse_infer_request(body, len(body), "m", "")


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (_tensor("A", "FP32", [2]), "no field is set"),
        (
            _tensor("A", "FP32", [1], data=[1], parameters={"binary_data_size": 4}),
            "set 'data' 'binary_data_size'",
        ),
        (_tensor("A", "FP32", [3], data=[1, 2]), "Shape does not match true shape"),
        (_tensor("A", "FP32", [2], data=[[1, 2], [3]]), "Unable to parse 'data'"),
        (_tensor("A", "FP32", [1], data=5), "expected a list"),
        (_tensor("A", "INT32", [2], data=[1.5, 2]), "INT32 expects integers, got float64"),
        (_tensor("A", "INT8", [1], data=[128]), "out of the range of INT8"),
        (_tensor("A", "UINT8", [1], data=[-1]), "out of the range of UINT8"),
        (_tensor("A", "BOOL", [1], data=[1]), "BOOL expects booleans"),
        (_tensor("A", "FP32", [1], data=["1"]), "FP32 expects numbers"),
        (_tensor("A", "BYTES", [2], data=["a", 1]), "expected strings, got 1"),
        (_tensor("A", "FP8", [1], data=[1]), "invalid datatype 'FP8'"),
        (
            _tensor("A", "FP32", [1], parameters={"binary_data_size": -1}),
            "Unable to parse 'binary_data_size'",
        ),
    ],
)
def test_invalid_inputs(item: dict[str, Any], message: str) -> None:
    with pytest.raises(errors.InvalidArgumentError, match=message):
        _parse(
            {"inputs": [item]},
            b"\0" * 4 if "binary_data_size" in item.get("parameters", {}) else b"",
        )


def test_shared_memory_input_is_passed_to_the_core_as_a_region() -> None:
    params = {"shared_memory_region": "r", "shared_memory_byte_size": 8, "other": 1}
    request, _ = _parse({"inputs": [_tensor("A", "FP32", [2], parameters=params)]})
    assert request.inputs[0].data is None
    assert request.inputs[0].region == RegionRef("r", 8, 0)
    assert request.inputs[0].parameters == {"other": 1}


def test_output_plan_and_parameters() -> None:
    header = {
        "inputs": [_tensor("A", "FP32", [1], data=[1])],
        "outputs": [
            {"name": "X", "parameters": {"binary_data": True}},
            {"name": "Y", "parameters": {"binary_data": False, "classification": 2}},
            {"name": "Z"},
        ],
        "parameters": {"binary_data_output": True, "priority": 3, "custom": "v"},
    }
    request, plan = _parse(header)
    assert [o.name for o in request.outputs] == ["X", "Y", "Z"]
    assert request.outputs[0].parameters == {}
    assert request.outputs[1].parameters == {"classification": 2}
    assert request.parameters == {"priority": 3, "custom": "v"}
    assert plan.is_binary("X") and not plan.is_binary("Y") and plan.is_binary("Z")
    assert plan.is_binary("unlisted")


def test_outputs_default_to_json() -> None:
    _, plan = _parse({"inputs": []})
    assert not plan.is_binary("X")


def test_binary_data_flag_must_be_a_boolean() -> None:
    header = {"inputs": [], "parameters": {"binary_data_output": "yes"}}
    with pytest.raises(errors.InvalidArgumentError, match="'binary_data_output'"):
        _parse(header)


# --- responses ------------------------------------------------------------------------------


def _decode(header: bytes, blobs: list[bytes | memoryview]) -> InferResult:
    """Decode a response as the unmodified tritonclient does."""
    body = header + b"".join(bytes(b) for b in blobs)
    return InferResult.from_response_body(body, header_length=len(header) if blobs else None)


def _response(*outputs: OutputTensor, request_id: str = "") -> InferResponse:
    return InferResponse("m", "1", request_id, list(outputs))


ROUND_TRIP = [
    np.array([[True, False]]),
    np.array([1, 2, 255], np.uint8),
    np.array([-5, 7], np.int16),
    np.array([[2**40, -1]], np.int64),
    np.array([0.25, -1.5], np.float16),
    np.array([0.1, 2.5, -3.75], np.float32),
    np.array([1e-300], np.float64),
]


@pytest.mark.parametrize("array", ROUND_TRIP, ids=lambda a: str(a.dtype))
@pytest.mark.parametrize("binary", [False, True])
def test_outputs_round_trip_through_tritonclient(array: np.ndarray, binary: bool) -> None:
    datatype = {
        "bool": "BOOL",
        "uint8": "UINT8",
        "int16": "INT16",
        "int64": "INT64",
        "float16": "FP16",
        "float32": "FP32",
        "float64": "FP64",
    }[array.dtype.name]
    out = OutputTensor("OUT", datatype, array.shape, array.tobytes())
    header, blobs = convert.encode_infer_response(_response(out), convert.OutputPlan(binary))
    assert bool(blobs) == binary
    result = _decode(header, blobs)
    np.testing.assert_array_equal(result.as_numpy("OUT"), array)
    assert result.as_numpy("OUT").dtype == array.dtype


def test_bf16_output_as_json_numbers() -> None:
    values = np.array([1.5, -2.0, 3.140625], ml_dtypes.bfloat16)
    out = OutputTensor("OUT", "BF16", (3,), values.tobytes())
    header, blobs = convert.encode_infer_response(_response(out), convert.OutputPlan())
    assert json.loads(header)["outputs"][0]["data"] == [1.5, -2.0, 3.140625]
    np.testing.assert_array_equal(_decode(header, blobs).as_numpy("OUT"), values)


def test_bytes_output_as_strings_or_binary_when_not_utf8() -> None:
    good = OutputTensor("S", "BYTES", (2,), struct.pack("<I", 2) + b"hi" + struct.pack("<I", 0))
    bad = OutputTensor("B", "BYTES", (1,), struct.pack("<I", 2) + b"\xff\xfe")
    header, blobs = convert.encode_infer_response(_response(good, bad), convert.OutputPlan())
    outputs = json.loads(header[: len(header)])["outputs"]
    assert outputs[0]["data"] == ["hi", ""]
    assert outputs[1]["parameters"] == {"binary_data_size": 6} and "data" not in outputs[1]
    result = _decode(header, blobs)
    assert result.as_numpy("S").tolist() == ["hi", ""]
    assert result.as_numpy("B").tolist() == [b"\xff\xfe"]


def test_response_header_fields() -> None:
    out = OutputTensor("O", "INT32", (1,), np.int32(5).tobytes(), {"p": 1})
    header, _ = convert.encode_infer_response(_response(out, request_id="r9"), convert.OutputPlan())
    assert json.loads(header) == {
        "id": "r9",
        "model_name": "m",
        "model_version": "1",
        "outputs": [
            {"name": "O", "datatype": "INT32", "shape": [1], "data": [5], "parameters": {"p": 1}}
        ],
    }
    header, _ = convert.encode_infer_response(_response(out), convert.OutputPlan())
    assert "id" not in json.loads(header)


def test_empty_binary_output_has_no_blob() -> None:
    out = OutputTensor("O", "FP32", (0,), b"")
    header, blobs = convert.encode_infer_response(_response(out), convert.OutputPlan(True))
    assert blobs == []
    assert json.loads(header)["outputs"][0]["parameters"] == {"binary_data_size": 0}


def test_region_output_has_no_data() -> None:
    out = OutputTensor("O", "FP32", (2,), None)
    header, blobs = convert.encode_infer_response(_response(out), convert.OutputPlan())
    assert blobs == [] and json.loads(header)["outputs"][0] == {
        "name": "O",
        "datatype": "FP32",
        "shape": [2],
    }


def test_malformed_output_is_an_internal_error() -> None:
    out = OutputTensor("O", "FP32", (1,), b"\0\0\0")
    with pytest.raises(errors.InternalError):
        convert.encode_infer_response(_response(out), convert.OutputPlan())


# --- metadata, statistics, index --------------------------------------------------------------


def test_metadata_json() -> None:
    meta = ModelMetadata("m", ("1", "2"), "python", (TensorMetadata("I", "FP32", (-1, 3)),), ())
    assert convert.model_metadata_json(meta) == {
        "name": "m",
        "versions": ["1", "2"],
        "platform": "python",
        "inputs": [{"name": "I", "datatype": "FP32", "shape": [-1, 3]}],
        "outputs": [],
    }
    server = convert.server_metadata_json(ServerMetadata("dlserve", "0.1", ("a", "b")))
    assert server == {"name": "dlserve", "version": "0.1", "extensions": ["a", "b"]}


def test_statistics_json_has_tritons_shape() -> None:
    d = DurationStat(2, 30)
    stats = ModelStatistics(
        "m", "1", 123, 4, 2, InferenceStats(success=d), (BatchStats(1, d, d, d),)
    )
    (row,) = convert.statistics_json([stats])["model_stats"]
    assert row["name"] == "m" and row["version"] == "1" and row["last_inference"] == 123
    assert row["inference_count"] == 4 and row["execution_count"] == 2
    assert row["inference_stats"]["success"] == {"count": 2, "ns": 30}
    assert set(row["inference_stats"]) == {
        "success",
        "fail",
        "queue",
        "compute_input",
        "compute_infer",
        "compute_output",
        "cache_hit",
        "cache_miss",
    }
    assert row["batch_stats"] == [
        {
            "batch_size": 1,
            "compute_input": {"count": 2, "ns": 30},
            "compute_infer": {"count": 2, "ns": 30},
            "compute_output": {"count": 2, "ns": 30},
        }
    ]


def test_repository_index_json() -> None:
    rows = convert.repository_index_json(
        [
            RepositoryEntry("a", "1", ModelState.READY, ""),
            RepositoryEntry("b", "", None, ""),
            RepositoryEntry("c", "", ModelState.UNAVAILABLE, "failed to load"),
        ]
    )
    assert rows == [
        {"name": "a", "version": "1", "state": "READY"},
        {"name": "b"},
        {"name": "c", "state": "UNAVAILABLE", "reason": "failed to load"},
    ]


def test_parse_json_object() -> None:
    assert convert.parse_json_object(b"", "x") == {}
    assert convert.parse_json_object(b'{"ready": true}', "x") == {"ready": True}
    with pytest.raises(errors.InvalidArgumentError, match="must be a JSON object"):
        convert.parse_json_object(b"[]", "x")
    with pytest.raises(errors.InvalidArgumentError, match="failed to parse the x request JSON"):
        convert.parse_json_object(b"{", "x")


# --- bodies: limits, compression, header length --------------------------------------------


def _receiver(*chunks: bytes) -> Any:
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]
    received: list[int] = []

    async def receive() -> dict[str, Any]:
        received.append(1)
        return messages.pop(0)

    receive.calls = received  # type: ignore[attr-defined]
    return receive


def test_body_over_the_limit_is_refused_unread() -> None:
    receive = _receiver(b"x")
    with pytest.raises(bodies.BodyRefusedError) as info:
        asyncio.run(bodies.read_body(receive, 2**31, 64))
    assert str(info.value).startswith(
        "request JSON size of 2147483648 bytes exceeds the maximum allowed input size of 64 bytes"
    )
    assert receive.calls == []


def test_streamed_body_is_refused_once_over_the_limit() -> None:
    receive = _receiver(b"a" * 40, b"b" * 40, b"c" * 40)
    with pytest.raises(bodies.BodyRefusedError, match="size of 80 bytes exceeds"):
        asyncio.run(bodies.read_body(receive, None, 64))
    assert len(receive.calls) == 2


def test_body_in_chunks_is_joined() -> None:
    assert asyncio.run(bodies.read_body(_receiver(b"ab", b"cd"), None, 64)) == b"abcd"
    assert asyncio.run(bodies.read_body(_receiver(b"ab"), 2, 64)) == b"ab"


def test_disconnect_while_reading() -> None:
    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    with pytest.raises(errors.CancelledError):
        asyncio.run(bodies.read_body(receive, None, 64))


def _inflate(body: bytes, encoding: bytes, limit: int) -> bytes | bytearray:
    return asyncio.run(bodies.decompress(body, encoding, limit))


@pytest.mark.parametrize("encoding", [b"gzip", b"deflate"])
def test_decompress(encoding: bytes) -> None:
    data = b"hello " * 100
    packed = gzip.compress(data) if encoding == b"gzip" else zlib.compress(data)
    assert _inflate(packed, encoding, 1000) == data
    with pytest.raises(errors.InvalidArgumentError, match="maximum allowed input size of 100"):
        _inflate(packed, encoding, 100)
    with pytest.raises(errors.InvalidArgumentError, match="failed to decompress"):
        _inflate(b"not compressed", encoding, 1000)
    with pytest.raises(errors.InvalidArgumentError, match="it is truncated"):
        _inflate(packed[: len(packed) // 2], encoding, 1000)


def test_unknown_content_encoding_is_unsupported() -> None:
    with pytest.raises(errors.UnsupportedError, match="Unsupported compression type"):
        _inflate(b"x", b"br", 10)
    assert _inflate(b"x", b"identity", 10) == b"x"


def _bomb(size: int) -> bytes:
    """``size`` zero bytes, gzipped (about a thousandth of it)."""
    deflater = zlib.compressobj(wbits=31)
    zeros = bytes(16 << 20)
    parts = [deflater.compress(zeros) for _ in range(size // len(zeros))]
    return b"".join([*parts, deflater.flush()])


def test_a_bomb_is_refused_in_slices() -> None:
    """256 MiB of zeros in 256 KiB of gzip, against a limit of 64 MiB: refused having
    inflated no more than the limit and a byte, with the event loop never held for longer
    than a slice's inflating (a ticker task sees it free all along)."""
    bomb, limit = _bomb(256 << 20), 64 << 20
    gaps: list[float] = []

    async def scenario() -> None:
        done = False

        async def ticker() -> None:
            last = time.perf_counter()
            while not done:
                await asyncio.sleep(0)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        tracemalloc.start()
        try:
            with pytest.raises(errors.InvalidArgumentError, match="maximum allowed input size"):
                await bodies.decompress(bomb, b"gzip", limit)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            done = True
        await task
        assert peak < limit + limit // 4 + 2 * bodies.INFLATE_SLICE, peak  # bytearray grows 1/8

    asyncio.run(scenario())
    assert len(gaps) >= limit // bodies.INFLATE_SLICE  # the loop ran between slices
    assert max(gaps) < 0.1, max(gaps)


@pytest.mark.parametrize(
    ("accept", "chosen"),
    [
        (b"gzip", b"gzip"),
        (b"br, deflate", b"deflate"),
        (b"gzip;q=0, deflate", b"deflate"),
        (b"identity", b""),
        (b"", b""),
    ],
)
def test_response_encoding(accept: bytes, chosen: bytes) -> None:
    assert bodies.response_encoding(accept) == chosen


@pytest.mark.parametrize("encoding", [b"gzip", b"deflate"])
def test_compress_parts(encoding: bytes) -> None:
    packed = bodies.compress([b"ab", memoryview(b"cd")], encoding)
    assert _inflate(packed, encoding, 100) == b"abcd"


def test_header_length() -> None:
    assert bodies.header_length(None, 10) == 10
    assert bodies.header_length(b"4", 10) == 4
    with pytest.raises(errors.InvalidArgumentError, match=r"should be in range \(0, 10\), got: 11"):
        bodies.header_length(b"11", 10)
    with pytest.raises(errors.InvalidArgumentError, match="Unable to parse"):
        bodies.header_length(b"ten", 10)


# --- the OpenAPI document ---------------------------------------------------------------------


def test_openapi_document_covers_every_route() -> None:

    document = json.loads((ROOT / "docs" / "openapi.json").read_text())
    routes = app.create_http_app(None, 1).router.routes  # type: ignore[arg-type]
    for route in routes:
        path = route.path.replace(":version}", "}")  # type: ignore[attr-defined]
        if path.endswith("{action:path}"):
            prefix = path.removesuffix("{action:path}")
            assert any(p.startswith(prefix) for p in document["paths"]), path
            continue
        assert path in document["paths"], path
        for method in route.methods - {"HEAD"}:  # type: ignore[attr-defined]
            assert method.lower() in document["paths"][path], (path, method)
