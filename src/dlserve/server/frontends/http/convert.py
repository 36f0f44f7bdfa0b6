"""HTTP/JSON <-> core types. The only place where tensors exist as JSON lists.

An inference request body is a JSON header, optionally followed by the binary
blobs of the inputs that carry ``parameters.binary_data_size`` (Triton's binary
tensor data extension). Inputs taken from the body are memoryview slices of it:
no copy here. Outputs go back as JSON ``data`` or as binary blobs after the
JSON header, per output (``parameters.binary_data``) or for the whole request
(``parameters.binary_data_output``).

Differences from Triton, on purpose: FP16 and BF16 tensors may be sent and
received as JSON numbers (Triton refuses both), and a BYTES output that is not
valid UTF-8 is returned as binary data rather than as invalid JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

from dlserve.errors import InternalError, InvalidArgumentError
from dlserve.server.frontends.http import shm
from dlserve.server.frontends.http.documents import (
    model_metadata_json as model_metadata_json,  # re-exported: the app calls them here
)
from dlserve.server.frontends.http.documents import repository_index_json as repository_index_json
from dlserve.server.frontends.http.documents import server_metadata_json as server_metadata_json
from dlserve.server.frontends.http.documents import statistics_json as statistics_json
from dlserve.tensors import dtypes
from dlserve.types import (
    InferRequest,
    InferResponse,
    InputTensor,
    OutputTensor,
    Parameters,
    ParamValue,
    RequestedOutput,
)

JsonObject = dict[str, Any]

# --- the request header, decoded and type-checked in one pass --------------------------


class _InputJSON(msgspec.Struct):
    name: str
    datatype: str
    shape: list[int]
    parameters: dict[str, ParamValue] = {}
    data: object = msgspec.UNSET


class _OutputJSON(msgspec.Struct):
    name: str
    parameters: dict[str, ParamValue] = {}


class _RequestJSON(msgspec.Struct):
    inputs: list[_InputJSON]
    id: str = ""
    outputs: list[_OutputJSON] = []
    parameters: dict[str, ParamValue] = {}


_decode_request = msgspec.json.Decoder(_RequestJSON).decode
_decode_any = msgspec.json.Decoder().decode
encode_json = msgspec.json.Encoder().encode

# Triton's words for JSON data that does not match its shape
SHAPE_MISMATCH: Final = "Unable to parse 'data': Shape does not match true shape of 'data' field"
_ONE_OF: Final = (
    "Input must set only one of the following fields: 'data', 'binary_data_size' in "
    "'parameters', 'shared_memory_region' in 'parameters'. But"
)


@dataclass(slots=True)
class OutputPlan:
    """How each output goes back: as JSON data or as a binary blob."""

    default_binary: bool = False
    binary: dict[str, bool] = field(default_factory=dict)

    def is_binary(self, name: str) -> bool:
        return self.binary.get(name, self.default_binary)


def parse_infer_request(
    body: bytes | bytearray | memoryview, header_length: int, model: str, version: str
) -> tuple[InferRequest, OutputPlan]:
    """The core request that an HTTP infer body describes, and how to answer it."""
    view = memoryview(body)
    try:
        parsed = _decode_request(view[:header_length])
    except (msgspec.DecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise InvalidArgumentError(f"failed to parse the request JSON buffer: {exc}") from None
    offset = header_length
    inputs: list[InputTensor] = []
    for item in parsed.inputs:
        tensor, offset = _input_tensor(item, view, offset, model)
        inputs.append(tensor)
    if offset != len(view):
        raise InvalidArgumentError(f"unexpected additional input data for model '{model}'")
    plan = OutputPlan()
    outputs = [_requested_output(o, plan) for o in parsed.outputs]
    parameters = parsed.parameters
    if "binary_data_output" in parameters:
        plan.default_binary = _flag(parameters, "binary_data_output")
        parameters = {k: v for k, v in parameters.items() if k != "binary_data_output"}
    request = InferRequest(model, version, parsed.id, inputs, outputs, parameters)
    return request, plan


def _input_tensor(
    item: _InputJSON, view: memoryview, offset: int, model: str
) -> tuple[InputTensor, int]:
    params = item.parameters
    has_data = item.data is not msgspec.UNSET
    has_binary = "binary_data_size" in params
    has_region = "shared_memory_region" in params
    if has_data + has_binary + has_region != 1:
        names = ("'data'", "'binary_data_size'", "'shared_memory_region'")
        given = [n for n, f in zip(names, (has_data, has_binary, has_region), strict=True) if f]
        raise InvalidArgumentError(
            f"{_ONE_OF} {'set ' + ' '.join(given) if given else 'no field is set'}"
        )
    shape = tuple(item.shape)
    if has_region:
        region = shm.region_of(params)
        rest = shm.without_region_keys(params)
        return InputTensor(item.name, item.datatype, shape, None, rest, region), offset
    if has_data:
        data = json_to_tensor_bytes(item.name, item.datatype, shape, item.data)
        return InputTensor(item.name, item.datatype, shape, data, params), offset
    size = params["binary_data_size"]
    if type(size) is not int or size < 0:
        raise InvalidArgumentError(
            f"Unable to parse 'binary_data_size' of input '{item.name}': expected an "
            f"unsigned integer, got {size!r}"
        )
    end = offset + size
    if end > len(view):
        raise InvalidArgumentError(
            f"unexpected size for input '{item.name}', expecting {end - len(view)} additional "
            f"bytes for model '{model}'"
        )
    rest = {k: v for k, v in params.items() if k != "binary_data_size"} if len(params) > 1 else {}
    return InputTensor(item.name, item.datatype, shape, view[offset:end], rest), end


def _requested_output(item: _OutputJSON, plan: OutputPlan) -> RequestedOutput:
    params = item.parameters
    if "shared_memory_region" in params:
        return _output_in_region(item.name, params)
    if "binary_data" not in params:
        return RequestedOutput(item.name, params)
    plan.binary[item.name] = _flag(params, "binary_data")
    return RequestedOutput(item.name, {k: v for k, v in params.items() if k != "binary_data"})


def _output_in_region(name: str, params: Parameters) -> RequestedOutput:
    for key in ("classification", "binary_data"):
        if key in params and (key == "classification" or _flag(params, key)):
            raise InvalidArgumentError(f"Output can't set both 'shared_memory_region' and '{key}'")
    rest = {k: v for k, v in shm.without_region_keys(params).items() if k != "binary_data"}
    return RequestedOutput(name, rest, shm.region_of(params))


def _flag(params: Parameters, key: str) -> bool:
    value = params[key]
    if type(value) is not bool:
        raise InvalidArgumentError(f"Unable to parse '{key}': expected a boolean, got {value!r}")
    return value


# --- JSON data -> tensor bytes ------------------------------------------------------------


def json_to_tensor_bytes(
    name: str, datatype: str, shape: tuple[int, ...], data: object
) -> memoryview:
    """The little-endian C-order bytes (BYTES: Triton's length-prefixed form) of a
    tensor given as JSON ``data``: a flat list of as many elements as ``shape`` has, or
    lists nested exactly as ``shape`` (anything else is refused with Triton's message)."""
    dtype = dtypes.from_wire(datatype)
    if dtype is None:
        raise InvalidArgumentError(f"invalid datatype '{datatype}' for input '{name}'")
    if not isinstance(data, list):
        raise InvalidArgumentError(f"Unable to parse 'data' of input '{name}': expected a list")
    expected = math.prod(shape)
    if dtype.is_bytes:
        items = _leaves(data, shape, expected)
        for item in items:
            if not isinstance(item, str):
                raise InvalidArgumentError(
                    f"Unable to parse 'data' of BYTES input '{name}': expected strings, got "
                    f"{item!r}"
                )
        serialized = dtypes.serialize_bytes(np.array(items, dtype=object).reshape(-1))
        return memoryview(serialized)
    integers = dtype.numpy_storage.kind in "iu" and dtype.wire != "BF16"
    try:
        raw = np.asarray(data)
        if integers and raw.dtype.kind == "f" and raw.size and np.abs(raw).max() >= 2**63:
            raw = np.asarray(data, dtype=object)  # numpy made floats of integers past int64
    except ValueError:  # ragged lists, or nested past numpy's 64 dimensions
        raise InvalidArgumentError(SHAPE_MISMATCH) from None
    if raw.shape != shape and (raw.ndim != 1 or raw.size != expected):
        raise InvalidArgumentError(SHAPE_MISMATCH)  # neither flat nor nested as the shape
    array = _cast(name, dtype, raw) if raw.size else np.empty(0, dtype.numpy_storage)
    contiguous: Any = np.ascontiguousarray(array)
    return memoryview(contiguous).cast("B")


def _leaves(data: list[object], shape: tuple[int, ...], expected: int) -> list[object]:
    """The elements of ``data``, flat or nested exactly as ``shape``, in row-major order
    (no recursion: any depth is safe, and a level that does not match stops the walk)."""
    if len(data) == expected and not any(isinstance(item, list) for item in data):
        return data  # flat
    level: list[object] = [data]
    for size in shape:
        below: list[object] = []
        for node in level:
            if not isinstance(node, list) or len(node) != size:
                raise InvalidArgumentError(SHAPE_MISMATCH)
            below.extend(node)
        level = below
    if any(isinstance(item, list) for item in level):
        raise InvalidArgumentError(SHAPE_MISMATCH)  # nested deeper than the shape
    return level


# Which JSON value kinds (numpy kinds of the parsed list) each type accepts.
_ACCEPTS: Final = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}
_KIND_NAMES: Final = {"b": "booleans", "i": "integers", "u": "integers", "f": "numbers"}


def _cast(name: str, dtype: dtypes.DType, raw: npt.NDArray[Any]) -> npt.NDArray[Any]:
    target: np.dtype[Any] = np.dtype(np.float32) if dtype.wire == "BF16" else dtype.numpy_storage
    kind = raw.dtype.kind
    if kind == "O" and target.kind in "iu" and all(type(v) is int for v in raw.flat):
        kind = "i"  # integers past int64, kept exact as Python ints
    if kind not in _ACCEPTS.get(target.kind, ""):
        raise InvalidArgumentError(
            f"Unable to parse 'data' of input '{name}': {dtype.wire} expects "
            f"{_KIND_NAMES[target.kind]}, got {raw.dtype.name} values"
        )
    if target.kind in "iu":
        info = np.iinfo(target)
        if raw.min() < info.min or raw.max() > info.max:
            raise InvalidArgumentError(
                f"Unable to parse 'data' of input '{name}': a value is out of the range of "
                f"{dtype.wire}"
            )
    # a number past FP16's or FP32's range is inf, as Triton casts it (no warning)
    with np.errstate(over="ignore"):
        array = raw.astype(target, copy=False)
    return float32_to_bf16(array) if dtype.wire == "BF16" else array


def float32_to_bf16(values: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """Round to nearest even, as torch and ml_dtypes do; NaN stays a quiet NaN."""
    bits = values.astype(np.float32, copy=False).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16
    out = rounded.astype(np.uint16)
    out[np.isnan(values)] = 0x7FC0
    return out


def bf16_to_float32(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    return (bits.astype(np.uint32) << 16).view(np.float32)


# --- the response ---------------------------------------------------------------------------


def encode_infer_response(
    response: InferResponse, plan: OutputPlan
) -> tuple[bytes, list[bytes | memoryview]]:
    """The JSON header and, in order, the binary blobs that follow it."""
    blobs: list[bytes | memoryview] = []
    outputs = [_output_json(o, plan.is_binary(o.name), blobs) for o in response.outputs]
    header: JsonObject = {}
    if response.id:
        header["id"] = response.id
    header["model_name"] = response.model_name
    header["model_version"] = response.model_version
    if response.parameters:
        header["parameters"] = response.parameters
    header["outputs"] = outputs
    return encode_json(header), blobs


def _output_json(output: OutputTensor, binary: bool, blobs: list[bytes | memoryview]) -> JsonObject:
    item: JsonObject = {"name": output.name, "datatype": output.datatype, "shape": output.shape}
    data = output.data
    values = None if binary or data is None else tensor_bytes_to_json(output.datatype, data)
    if values is not None:
        item["data"] = values
        if output.parameters:
            item["parameters"] = output.parameters
    elif data is not None:
        item["parameters"] = {**output.parameters, "binary_data_size": len(memoryview(data))}
        if len(data):
            blobs.append(data)
    elif output.parameters:
        item["parameters"] = output.parameters
    return item


def tensor_bytes_to_json(datatype: str, data: bytes | memoryview) -> list[Any] | None:
    """A tensor's elements as a flat JSON list; None where JSON cannot carry them
    (BYTES that are not UTF-8, an unknown type): the caller sends those as binary."""
    dtype = dtypes.from_wire(datatype)
    if dtype is None:
        return None
    try:
        if dtype.is_bytes:
            return [item.decode("utf-8") for item in dtypes.deserialize_bytes(data)]
        array = np.frombuffer(data, dtype=dtype.numpy_storage)
    except UnicodeDecodeError:
        return None
    except ValueError as exc:
        raise InternalError(f"output tensor of type {datatype} is malformed: {exc}") from None
    if dtype.wire == "BF16":
        array = bf16_to_float32(array)
    values: list[Any] = array.tolist()
    return values


# --- other requests and replies -------------------------------------------------------------


def parse_json_object(
    body: bytes | bytearray | memoryview, what: str, required: bool = False
) -> JsonObject:
    """A JSON object body; an empty one is ``{}`` unless it is ``required``."""
    if not body:
        if required:
            raise InvalidArgumentError(f"failed to parse the {what} request JSON: it is empty")
        return {}
    try:
        value = _decode_any(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise InvalidArgumentError(f"failed to parse the {what} request JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgumentError(f"the {what} request must be a JSON object")
    return value
