"""Translation between Triton's gRPC inference messages and core types (the rest: control.py).

The infer path does not let protobuf touch tensor bytes. A ModelInferRequest
arrives as the bytes gRPC received: :func:`split_infer_request` walks its
top-level fields, keeps each ``raw_input_contents`` entry (field 7) as a
``memoryview`` into those bytes, and hands only the small rest to protobuf. The walk
is in Python, so it is bounded by the message's real structure: bytes that are not a
ModelInferRequest's fields are refused where they start (INVALID_ARGUMENT), and a
message of more than ``max_fields`` fields after that many steps (the server walks
in turns of the event loop: :func:`split_in_turns`). The same walk
(:class:`ArrivingRequest`) looks at a message that arrives in pieces, so that one which is
no ModelInferRequest is refused from its first bytes, before the rest is gathered. A
response is serialized the other way round: protobuf writes the metadata and
each output's bytes are appended as a ``raw_output_contents`` field (6), so
they are copied once, into the message gRPC sends.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

import numpy as np
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from dlserve.errors import InvalidArgumentError
from dlserve.server.core.streaming import StreamItem
from dlserve.server.frontends.grpc import shm
from dlserve.server.frontends.requests import checked_version
from dlserve.tensors import dtypes
from dlserve.types import (
    InferRequest,
    InferResponse,
    InputTensor,
    Parameters,
    ParamValue,
    RequestedOutput,
)

_InferRequestMessage: Final = pb.ModelInferRequest
_InferResponseMessage: Final = pb.ModelInferResponse
_StreamResponseMessage: Final = pb.ModelStreamInferResponse
_Duration: Final = pb.StatisticDuration
_TensorMetadata: Final = pb.ModelMetadataResponse.TensorMetadata

# Wire keys (field number << 3 | wire type 2, length-delimited).
# ModelInferRequest's fields: model_name, model_version, id, parameters, inputs, outputs,
# raw_input_contents (1 to 7), every one length-delimited, every key one byte
_FIELD_NUMBERS: Final = range(1, 8)
_KEYS: Final = frozenset((number << 3) | 2 for number in _FIELD_NUMBERS)
_RAW_INPUT_KEY: Final = (7 << 3) | 2  # ModelInferRequest.raw_input_contents
_RAW_OUTPUT_TAG: Final = bytes([(6 << 3) | 2])  # ModelInferResponse.raw_output_contents
_STREAM_RESPONSE_TAG: Final = bytes([(2 << 3) | 2])  # ModelStreamInferResponse.infer_response
_MALFORMED: Final = "malformed ModelInferRequest"
_RUNS_PAST: Final = f"{_MALFORMED}: field runs past the end of the message"
# the top-level fields a ModelInferRequest may have (--grpc-infer-max-fields): a message
# of millions of tiny fields is refused after this many steps, not walked to its end
MAX_FIELDS: Final = 4096


# -- protobuf wire format --------------------------------------------------------------
def _read_varint(data: bytes | memoryview, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while pos < end and shift < 64:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
    raise InvalidArgumentError(f"{_MALFORMED}: bad varint")


def encode_varint(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def split_infer_request(
    data: bytes | memoryview, max_fields: int = MAX_FIELDS
) -> tuple[bytes | memoryview, list[memoryview]]:
    """The message without its raw_input_contents, and those contents as views of ``data``.

    Its walk costs one step per field that a ModelInferRequest has, and stops at the first
    thing that is not one: a key that is not one of its seven fields (field number 0,
    another wire type, an unknown field), a length past the end, or more than
    ``max_fields`` fields (so millions of tiny fields cost ``max_fields`` steps; that
    there are no more raw contents than inputs is checked once the inputs are read).
    """
    *_, split = _split_steps(data, max_fields)
    assert split is not None
    return split


async def split_in_turns(
    data: bytes | memoryview, max_fields: int = MAX_FIELDS
) -> tuple[bytes | memoryview, list[memoryview]]:
    """:func:`split_infer_request`, letting the event loop turn after every
    ``_FIELDS_PER_STEP`` fields: a message of thousands of tiny fields (up to
    ``max_fields``, a millisecond or two of Python) does not hold the other clients up."""
    for split in _split_steps(data, max_fields):
        if split is not None:
            return split
        await asyncio.sleep(0)
    raise AssertionError("the walk ends with its split")


_FIELDS_PER_STEP: Final = 256  # fields walked between two turns of the loop (tens of us)


def _split_steps(
    data: bytes | memoryview, max_fields: int
) -> Iterator[tuple[bytes | memoryview, list[memoryview]] | None]:
    """The walk of :func:`split_infer_request`: None after each ``_FIELDS_PER_STEP``
    fields (a pause), the split last. Keys and lengths under 128 (nearly all) are read
    inline: this loop runs per request."""
    view = memoryview(data)
    raws: list[memoryview] = []
    kept: list[memoryview] = []
    kept_from = pos = 0
    end = len(data)
    for count in range(max_fields):
        if pos >= end:
            break
        if count and not count % _FIELDS_PER_STEP:
            yield None
        field_start = pos
        key = data[pos]
        if key not in _KEYS:
            raise InvalidArgumentError(_bad_key(data, pos))
        if pos + 1 < end and data[pos + 1] < 0x80:
            value_start = pos + 2
            pos = value_start + data[pos + 1]
        else:
            length, value_start = _read_varint(data, pos + 1, end)
            pos = value_start + length
        if pos > end:
            raise InvalidArgumentError(_RUNS_PAST)
        if key == _RAW_INPUT_KEY:
            if kept_from < field_start:
                kept.append(view[kept_from:field_start])
            raws.append(view[value_start:pos])
            kept_from = pos
    else:
        if pos < end:
            raise _too_many_fields(max_fields)
    if not raws:
        yield data, raws
        return
    kept.append(view[kept_from:end])
    yield b"".join(kept), raws


class ArrivingRequest:
    """The walk of :func:`split_infer_request` over a ModelInferRequest whose bytes are
    still arriving (a message in pieces, its size known from gRPC's prefix): called with
    the message's buffer and how much of it has arrived, it steps over each field whose key
    and length are in, and raises the error the whole message would get as soon as the
    bytes that decide it are in. A message that is not one (64 MiB of zeros, millions of
    tiny fields) is refused after its first bytes, not gathered to its end first. Each
    look steps over ``_FIELDS_PER_LOOK`` fields at most (the rest at the next look), so a
    piece of thousands of tiny fields costs the event loop little at a time."""

    __slots__ = ("_fields", "_max_fields", "_pos")
    _HEAD: Final = 20  # a key's varint and a length's: what decides a field's extent
    _FIELDS_PER_LOOK: Final = 64

    def __init__(self, max_fields: int = MAX_FIELDS) -> None:
        self._max_fields = max_fields
        self._pos = 0  # where the next field starts
        self._fields = 0  # fields stepped over

    def __call__(self, data: memoryview, arrived: int) -> None:
        pos, end = self._pos, len(data)
        for _ in range(self._FIELDS_PER_LOOK):
            if pos >= end:
                break
            if self._fields == self._max_fields:
                raise _too_many_fields(self._max_fields)
            if arrived < min(end, pos + self._HEAD):
                break
            if data[pos] not in _KEYS:
                raise InvalidArgumentError(_bad_key(data[: min(end, pos + self._HEAD)], pos))
            length, value_start = _read_varint(data, pos + 1, end)
            pos = value_start + length
            if pos > end:
                raise InvalidArgumentError(_RUNS_PAST)
            self._fields += 1
        self._pos = pos


def _too_many_fields(max_fields: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"{_MALFORMED}: more than {max_fields} fields (--grpc-infer-max-fields)"
    )


def _bad_key(data: bytes | memoryview, pos: int) -> str:
    """Why the key at ``pos`` is none of a ModelInferRequest's (field number, wire type)."""
    key, _ = _read_varint(data, pos, len(data))
    number, wire_type = key >> 3, key & 7
    if number == 0:
        what = "field number 0"
    elif number in _FIELD_NUMBERS:
        what = f"field {number} with wire type {wire_type} (it is length-delimited)"
    else:
        what = f"unknown field {number}"
    return f"{_MALFORMED}: {what} at byte {pos}"


# -- parameters ------------------------------------------------------------------------
def params_from_message(params: Any) -> Parameters:
    """A map<string, InferParameter> as python values."""
    return {key: shm.param_value(key, param) for key, param in params.items()}


def fill_params(target: Any, params: Mapping[str, ParamValue]) -> None:
    """Write python values into a map<string, InferParameter>."""
    for key, value in params.items():
        param = target[key]
        if isinstance(value, bool):  # before int: bool is an int
            param.bool_param = value
        elif isinstance(value, int):
            if value > 0x7FFF_FFFF_FFFF_FFFF:
                param.uint64_param = value
            else:
                param.int64_param = value
        elif isinstance(value, float):
            param.double_param = value
        else:
            param.string_param = value


# -- ModelInferRequest -> InferRequest -------------------------------------------------
# Typed contents: field, the wire type its values have, the datatypes it may carry.
_CONTENTS: Final = (
    ("bool_contents", "BOOL", ("BOOL",)),
    ("int_contents", "INT32", ("INT8", "INT16", "INT32")),
    ("int64_contents", "INT64", ("INT64",)),
    ("uint_contents", "UINT32", ("UINT8", "UINT16", "UINT32")),
    ("uint64_contents", "UINT64", ("UINT64",)),
    ("fp32_contents", "FP32", ("FP32",)),
    ("fp64_contents", "FP64", ("FP64",)),
    ("bytes_contents", "BYTES", ("BYTES",)),
)


def _serialize_bytes_elements(values: Sequence[bytes]) -> bytes:
    parts: list[bytes] = []
    for value in values:
        parts.append(len(value).to_bytes(4, "little"))
        parts.append(value)
    return b"".join(parts)


def _typed_values(values: Any, field_type: str, datatype: str) -> bytes:
    if field_type == "BYTES":
        return _serialize_bytes_elements(values)
    source = dtypes.BY_WIRE[field_type].numpy_storage
    target = dtypes.BY_WIRE[datatype].numpy_storage
    array = np.array(values, dtype=source)
    # Narrower integers keep their low bytes, as Triton does.
    return (array if source == target else array.astype(target)).tobytes()


def contents_bytes(tensor: Any, model: str) -> memoryview:
    """An input's typed ``contents`` as raw tensor bytes (BYTES length-prefixed)."""
    found: bytes | None = None
    contents = tensor.contents
    for field, field_type, datatypes in _CONTENTS:
        values = getattr(contents, field)
        if not values:
            continue
        where = f"for input tensor '{tensor.name}' for model '{model}'"
        if found is not None:
            raise InvalidArgumentError(
                f"unexpected explicit tensor data {where}, binary data was already supplied."
            )
        if tensor.datatype not in datatypes:
            raise InvalidArgumentError(
                f"unexpected explicit tensor data {where} of type '{field_type}', expected "
                f"datatype '{tensor.datatype}'"
            )
        found = _typed_values(values, field_type, tensor.datatype)
    return memoryview(found if found is not None else b"")


def _input_tensors(message: Any, raws: Sequence[memoryview]) -> list[InputTensor]:
    model = message.model_name
    inputs: list[InputTensor] = []
    used = 0
    for tensor in message.inputs[:]:  # a slice iterates faster than the container
        params: Parameters = {}
        region = None
        if tensor.parameters:
            params, region = shm.tensor_params(tensor)
        data: memoryview | None = None
        if region is not None:
            pass  # in a client's region: no bytes in the request
        elif tensor.HasField("contents"):
            if raws:
                raise InvalidArgumentError(
                    "contents field must not be specified when using raw_input_contents for "
                    f"'{tensor.name}' for model '{model}'"
                )
            data = contents_bytes(tensor, model)
        elif used < len(raws):
            data = raws[used]
            used += 1
        else:
            raise InvalidArgumentError(
                f"unable to find data for input tensor '{tensor.name}' for model '{model}' in "
                "request."
            )
        shape = tuple(tensor.shape[:])  # twice as fast as tuple(container)
        inputs.append(InputTensor(tensor.name, tensor.datatype, shape, data, params, region))
    if used != len(raws):
        raise InvalidArgumentError(
            f"expected {used} raw_input_contents for model '{model}' (one per input not in "
            f"shared memory), got {len(raws)}"
        )
    return inputs


def _requested_outputs(message: Any) -> list[RequestedOutput]:
    outputs: list[RequestedOutput] = []
    if not message.outputs:  # the common case; iterating even an empty container costs
        return outputs
    for output in message.outputs[:]:
        if not output.parameters:
            outputs.append(RequestedOutput(output.name))
            continue
        params, region = shm.tensor_params(output)
        outputs.append(RequestedOutput(output.name, params, region))
    return outputs


def infer_request_from_message(
    message: Any, raws: Sequence[memoryview] | None = None
) -> InferRequest:
    """A parsed ModelInferRequest as a core request; ``raws`` replaces its raw contents."""
    if raws is None:
        raws = [memoryview(raw) for raw in message.raw_input_contents]
    params = params_from_message(message.parameters) if message.parameters else {}
    return InferRequest(
        message.model_name, checked_version(message.model_version), message.id,
        _input_tensors(message, raws), _requested_outputs(message), params,
    )  # fmt: skip


def parse_infer_request(data: bytes | memoryview, max_fields: int = MAX_FIELDS) -> InferRequest:
    """A serialized ModelInferRequest as a core request; raw inputs are views of ``data``."""
    return _request_of_split(*split_infer_request(data, max_fields))


async def parse_in_turns(data: bytes | memoryview, max_fields: int = MAX_FIELDS) -> InferRequest:
    """:func:`parse_infer_request`, its walk in turns of the event loop
    (:func:`split_in_turns`): what the server's handlers call."""
    return _request_of_split(*await split_in_turns(data, max_fields))


def _request_of_split(metadata: bytes | memoryview, raws: list[memoryview]) -> InferRequest:
    """The core request of a ModelInferRequest split by :func:`split_infer_request` (or
    :func:`split_in_turns`)."""
    try:
        message = _InferRequestMessage.FromString(metadata)
    except DecodeError as exc:
        raise InvalidArgumentError(f"{_MALFORMED}: {exc}") from None
    return infer_request_from_message(message, raws)


# -- InferResponse -> ModelInferResponse -----------------------------------------------
def infer_response_parts(response: InferResponse) -> tuple[list[bytes | memoryview], int]:
    """A ModelInferResponse as pieces to join, and their total size."""
    message = _InferResponseMessage(
        model_name=response.model_name, model_version=response.model_version, id=response.id
    )
    add_output = message.outputs.add
    raw: list[bytes | memoryview] = []
    size = 0
    for output in response.outputs:
        tensor = add_output(name=output.name, datatype=output.datatype, shape=output.shape)
        if output.parameters:
            fill_params(tensor.parameters, output.parameters)
        data = output.data if output.data is not None else b""  # in a region: empty, as Triton
        nbytes = data.nbytes if isinstance(data, memoryview) else len(data)
        header = _RAW_OUTPUT_TAG + encode_varint(nbytes)
        raw += (header, data)
        size += len(header) + nbytes
    if response.parameters:
        fill_params(message.parameters, response.parameters)
    metadata = message.SerializeToString()
    return [metadata, *raw], size + len(metadata)


def serialize_infer_response(response: InferResponse) -> bytes:
    return b"".join(infer_response_parts(response)[0])


def stream_response_parts(response: InferResponse) -> tuple[list[bytes | memoryview], int]:
    """A ModelStreamInferResponse carrying ``response``, as pieces (the outputs' data not
    copied: a response waiting for a slow reader is held once) and their total size."""
    parts, size = infer_response_parts(response)
    head = _STREAM_RESPONSE_TAG + encode_varint(size)
    return [head, *parts], len(head) + size


def serialize_stream_response(response: InferResponse) -> bytes:
    """A ModelStreamInferResponse carrying ``response``."""
    return b"".join(stream_response_parts(response)[0])


FINAL_RESPONSE: Final = "triton_final_response"  # a response parameter


def stream_item(
    request: InferRequest, item: StreamItem, empty_final: bool
) -> bytes | tuple[list[bytes | memoryview], int] | None:
    """One streamed response as a ModelStreamInferResponse, Triton's way: an error in
    ``error_message``; with ``triton_enable_empty_final_response`` every response says
    whether it is the last, and a bare final flag becomes an empty response (without it,
    a bare final flag sends nothing)."""
    if item.error is not None:
        return serialize_stream_error(item.error.message, request.id)
    response = item.response
    if response is None:
        if not (item.final and empty_final):
            return None
        response = InferResponse(request.model_name, item.model_version, request.id, [])
    if empty_final:
        response = dataclasses.replace(
            response, parameters={**response.parameters, FINAL_RESPONSE: item.final}
        )
    return stream_response_parts(response)


def serialize_stream_error(message: str, request_id: str) -> bytes:
    """A failed stream request: the error, and the id so the client knows which one."""
    infer_response = _InferResponseMessage(id=request_id)
    return bytes(
        _StreamResponseMessage(
            error_message=message, infer_response=infer_response
        ).SerializeToString()
    )


def request_id_of(data: bytes | memoryview) -> str:
    """The id of a serialized request that failed to convert, or "" when unreadable."""
    try:
        metadata, _ = split_infer_request(data)
        return str(_InferRequestMessage.FromString(metadata).id)
    except (InvalidArgumentError, DecodeError):
        return ""
