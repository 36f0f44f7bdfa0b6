"""Shared-memory parameters and peers as the frontends translate them (bytes in, core types out).

gRPC requests are built by tritonclient itself (``set_shared_memory``), then bent where a
test needs a parameter tritonclient would never send.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import InferInput, InferRequestedOutput
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc._utils import _get_inference_request

from dlserve import errors
from dlserve.server.frontends.grpc import convert as grpc_convert
from dlserve.server.frontends.grpc import shm as grpc_shm
from dlserve.server.frontends.http import convert as http_convert
from dlserve.server.frontends.http import shm as http_shm
from dlserve.types import Peer, RegionRef, RegionStatus


# -- gRPC ------------------------------------------------------------------------------------
def grpc_request(outputs: list[InferRequestedOutput] | None = None) -> Any:
    """INPUT0 in region "in" (64 bytes at 8), INPUT1 as raw bytes: a mixed request."""
    in_region = InferInput("INPUT0", [16], "FP32").set_shared_memory("in", 64, offset=8)
    raw = InferInput("INPUT1", [16], "FP32")
    raw.set_data_from_numpy(np.ones(16, np.float32))
    return _get_inference_request(
        model_name="m", inputs=[in_region, raw], model_version="", request_id="",
        outputs=outputs, sequence_id=0, sequence_start=False, sequence_end=False,
        priority=0, timeout=None, parameters=None,
    )  # fmt: skip


def test_grpc_inputs_and_outputs_in_regions() -> None:
    output = InferRequestedOutput("OUTPUT0")
    output.set_shared_memory("out", 64)
    request = grpc_convert.parse_infer_request(
        grpc_request([output, InferRequestedOutput("OUTPUT1")]).SerializeToString()
    )
    first, second = request.inputs
    assert (first.data, first.region, first.parameters) == (None, RegionRef("in", 64, 8), {})
    assert second.region is None and second.data is not None and second.data.nbytes == 64
    assert [(o.name, o.region, o.parameters) for o in request.outputs] == [
        ("OUTPUT0", RegionRef("out", 64, 0), {}),
        ("OUTPUT1", None, {}),
    ]


def _bent(key: str, **value: Any) -> bytes:
    message = grpc_request()
    param = message.inputs[0].parameters[key]
    for field, v in value.items():
        setattr(param, field, v)
    return bytes(message.SerializeToString())


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_bent("shared_memory_region", int64_param=3),
         "invalid value type for 'shared_memory_region' parameter for tensor 'INPUT0', expected "
         "string_param."),
        (_bent("shared_memory_offset", uint64_param=3),
         "invalid value type for 'shared_memory_offset' parameter for tensor 'INPUT0', expected "
         "int64_param."),
        (_bent("shared_memory_byte_size", string_param="64"),
         "invalid value type for 'shared_memory_byte_size' parameter for tensor 'INPUT0', "
         "expected int64_param."),
    ],
)  # fmt: skip
def test_grpc_parameter_types(data: bytes, message: str) -> None:
    with pytest.raises(errors.InvalidArgumentError) as info:
        grpc_convert.parse_infer_request(data)
    assert info.value.message == message


def test_grpc_region_parameters_go_together() -> None:
    message = grpc_request()
    params = message.inputs[0].parameters
    del params["shared_memory_byte_size"]
    with pytest.raises(errors.InvalidArgumentError, match="'shared_memory_byte_size' must be"):
        grpc_convert.parse_infer_request(message.SerializeToString())
    del params["shared_memory_region"]
    with pytest.raises(
        errors.InvalidArgumentError,
        match="'shared_memory_offset' can not be specified without 'shared_memory_region' "
        "parameter for tensor 'INPUT0'",
    ):
        grpc_convert.parse_infer_request(message.SerializeToString())


def test_grpc_raw_contents_count_only_inputs_outside_regions() -> None:
    message = grpc_request()
    message.raw_input_contents.append(b"\0" * 64)
    with pytest.raises(errors.InvalidArgumentError, match="expected 1 raw_input_contents"):
        grpc_convert.parse_infer_request(message.SerializeToString())


@pytest.mark.parametrize(
    ("text", "peer"),
    [("ipv4:127.0.0.1:50051", Peer("127.0.0.1", 50051)), ("ipv6:[::1]:50051", Peer("::1", 50051)),
     ("ipv6:%5B::1%5D:7", Peer("::1", 7)), ("ipv6:[fe80::1%25eth0]:7", Peer("fe80::1%eth0", 7)),
     ("unix:/tmp/socket", Peer(None)), ("unix-abstract:name", Peer(None)), ("", Peer("")),
     (None, Peer("")), ("vsock:3:4", Peer(""))],
)  # fmt: skip
def test_grpc_peers(text: str | None, peer: Peer) -> None:
    assert grpc_shm.peer_of(text) == peer


def test_grpc_status_response() -> None:
    response = grpc_shm.status_response([RegionStatus("a", "/k", 3, 9)])
    assert response == pb.SystemSharedMemoryStatusResponse(
        regions={"a": pb.SystemSharedMemoryStatusResponse.RegionStatus(
            name="a", key="/k", offset=3, byte_size=9)}
    )  # fmt: skip


# -- HTTP ------------------------------------------------------------------------------------
def http_parse(header: dict[str, Any]) -> Any:
    body = json.dumps(header).encode()
    return http_convert.parse_infer_request(body, len(body), "m", "")[0]


def region_input(**params: Any) -> dict[str, Any]:
    return {"name": "A", "datatype": "FP32", "shape": [2], "parameters": params}


def test_http_inputs_and_outputs_in_regions() -> None:
    request = http_parse({
        "inputs": [region_input(shared_memory_region="in", shared_memory_byte_size=8,
                                shared_memory_offset=2**64 - 32)],
        "outputs": [{"name": "X", "parameters": {"shared_memory_region": "out",
                                                 "shared_memory_byte_size": 8,
                                                 "binary_data": False, "other": 1}}],
    })  # fmt: skip
    assert request.inputs[0].region == RegionRef("in", 8, 2**64 - 32)
    assert request.inputs[0].data is None
    assert (request.outputs[0].region, request.outputs[0].parameters) == (
        RegionRef("out", 8, 0),
        {"other": 1},
    )


@pytest.mark.parametrize(
    ("params", "message"),
    [({"shared_memory_region": 3}, "Unable to parse 'shared_memory_region'"),
     ({"shared_memory_region": "r", "shared_memory_offset": -1},
      "Unable to parse 'shared_memory_offset'"),
     ({"shared_memory_region": "r", "shared_memory_byte_size": "8"},
      "Unable to parse 'shared_memory_byte_size'"),
     ({"shared_memory_region": "r", "binary_data_size": 8},
      "Input must set only one of the following fields")],
)  # fmt: skip
def test_http_bad_input_regions(params: dict[str, Any], message: str) -> None:
    with pytest.raises(errors.InvalidArgumentError, match=message):
        http_parse({"inputs": [region_input(**params)]})


@pytest.mark.parametrize("other", [{"binary_data": True}, {"classification": 2}])
def test_http_an_output_in_a_region_is_not_also_binary_or_classified(
    other: dict[str, Any],
) -> None:
    output = {"name": "X", "parameters": {"shared_memory_region": "r", **other}}
    with pytest.raises(errors.InvalidArgumentError) as info:
        http_parse({"inputs": [region_input(shared_memory_region="r")], "outputs": [output]})
    key = next(iter(other))
    assert info.value.message == f"Output can't set both 'shared_memory_region' and '{key}'"


@pytest.mark.parametrize(
    ("client", "peer"),
    [(("127.0.0.1", 5), Peer("127.0.0.1", 5)), (["::1", 5], Peer("::1", 5)), (None, Peer(None)),
     ("odd", Peer(""))],
)  # fmt: skip
def test_http_peers(client: object, peer: Peer) -> None:
    assert http_shm.peer_of(client) == peer


def test_claimed_pids() -> None:
    """A client's word for its pid travels with the peer (the core decides whether to
    believe it); anything but digits is no claim."""
    assert grpc_shm.claimed_pid([("dlserve-client-pid", "42"), ("x", "1")]) == 42
    assert grpc_shm.claimed_pid([("dlserve-client-pid", "-1")]) is None
    assert grpc_shm.claimed_pid(None) is None
    assert grpc_shm.peer_of("unix:", 42) == Peer(None, pid=42)
    assert http_shm.peer_of(("127.0.0.1", 5), "42") == Peer("127.0.0.1", 5, 42)
    assert http_shm.peer_of(None, "x") == Peer(None)
