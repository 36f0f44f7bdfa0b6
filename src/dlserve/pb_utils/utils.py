"""pb_utils' module-level helpers: lookups by name, data-type conversions, constants."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from dlserve.pb_utils import arguments
from dlserve.pb_utils.exceptions import TritonError, TritonModelException
from dlserve.pb_utils.request import InferenceRequest, InferenceResponse
from dlserve.pb_utils.runtime import current as _runtime
from dlserve.pb_utils.tensor import Tensor
from dlserve.tensors import dtypes

# model_config.proto's DataType values (tests check them against dlserve's dtype table).
TYPE_INVALID: Final = 0
TYPE_BOOL: Final = 1
TYPE_UINT8: Final = 2
TYPE_UINT16: Final = 3
TYPE_UINT32: Final = 4
TYPE_UINT64: Final = 5
TYPE_INT8: Final = 6
TYPE_INT16: Final = 7
TYPE_INT32: Final = 8
TYPE_INT64: Final = 9
TYPE_FP16: Final = 10
TYPE_FP32: Final = 11
TYPE_FP64: Final = 12
TYPE_STRING: Final = 13
TYPE_BF16: Final = 14

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START: Final = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END: Final = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL: Final = 1
TRITONSERVER_REQUEST_RELEASE_ALL: Final = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE: Final = 2
TRITONSERVER_MEMORY_CPU: Final = 0
TRITONSERVER_MEMORY_CPU_PINNED: Final = 1
TRITONSERVER_MEMORY_GPU: Final = 2


class PreferredMemory:
    """Where a BLS caller prefers the callee's outputs (``InferenceRequest(preferred_memory=)``).

    dlserve's outputs are views wherever they already are; the preference is kept for
    compatibility (see docs/differences.md).
    """

    def __init__(self, preferred_memory_type: int, preferred_device_id: int = 0) -> None:
        if preferred_memory_type not in (0, 1, 2):
            raise TritonModelException(f"unknown memory type {preferred_memory_type}")
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


ModelConfigLike = Mapping[str, Any] | str


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    for tensor in inference_request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    for tensor in inference_response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


def get_output_buffer(
    request: InferenceRequest, name: str, shape: Sequence[int], dtype: str | int | Any
) -> Tensor:
    """dlserve's addition: a tensor over the place where output ``name`` of ``request``
    must end up, for the model to write into (zero copies). Return it in the response's
    output tensors as it is, or wrapped again with ``Tensor.from_dlpack``.

    In a client's CUDA shared-memory region it is a GPU tensor on the region's device; in a
    system shared-memory region, or when the output goes back in the response, a host
    tensor. ``dtype`` is a wire name ("FP32"), a TYPE_* code or a numpy dtype.
    """
    try:
        name = arguments.text(name, "the output's name")
    except arguments.NotText:
        raise arguments.incompatible(
            "get_output_buffer", _BUFFER_SIGNATURE, (request, name, shape, dtype)
        ) from None
    resolved = _dtype_of(dtype)
    if resolved is None:
        raise TritonModelException(f"get_output_buffer('{name}'): unknown data type {dtype!r}")
    make = getattr(request, "_output_buffer", None)
    if make is None:
        raise TritonModelException(
            "get_output_buffer works for the requests that execute() receives"
        )
    try:
        tensor: Tensor = make(name, [int(dim) for dim in shape], resolved)
    except TritonError as exc:
        raise TritonModelException(exc.message()) from None
    return tensor


_BUFFER_SIGNATURE: Final = (
    "(request: InferenceRequest, name: str, shape: List[int], dtype: object) -> Tensor"
)


def _dtype_of(dtype: str | int | Any) -> dtypes.DType | None:
    if isinstance(dtype, str):
        return dtypes.from_wire(dtype) or dtypes.from_config(dtype)
    if isinstance(dtype, int):
        return dtypes.BY_CONFIG_CODE.get(dtype)
    try:
        return dtypes.from_numpy(np.dtype(dtype))
    except TypeError:
        return None


def _config_entry(model_config: ModelConfigLike, key: str, name: str) -> Any:
    config = json.loads(model_config) if isinstance(model_config, str) else model_config
    for entry in config.get(key, []):
        if entry.get("name") == name:
            return entry
    return None


def get_input_config_by_name(model_config: ModelConfigLike, name: str) -> Any:
    """The input's entry of the config dict (``json.loads(args['model_config'])``), or None."""
    return _config_entry(model_config, "input", name)


def get_output_config_by_name(model_config: ModelConfigLike, name: str) -> Any:
    return _config_entry(model_config, "output", name)


def using_decoupled_model_transaction_policy(model_config: ModelConfigLike) -> bool:
    config = json.loads(model_config) if isinstance(model_config, str) else model_config
    policy = config.get("model_transaction_policy") or {}
    return bool(policy.get("decoupled", False))


def triton_to_numpy_type(data_type: int) -> Any:
    """The numpy type of a TYPE_* value (np.object_ for TYPE_STRING); None for BF16."""
    dtype = dtypes.BY_CONFIG_CODE.get(data_type)
    if dtype is None or dtype.numpy is None:
        return None
    return dtype.numpy.type


def numpy_to_triton_type(data_type: Any) -> int | None:
    """The TYPE_* value of a numpy dtype or type; None when Triton has none."""
    try:
        dtype = dtypes.from_numpy(data_type)
    except TypeError:
        return None
    return None if dtype is None else dtype.config_code


_STRING_TO_NUMPY: Final[dict[str, Any]] = {
    d.config: (bool if d.wire == "BOOL" else d.numpy.type)
    for d in dtypes.ALL
    if d.numpy is not None
}


def triton_string_to_numpy(triton_type_string: str) -> Any:
    """``"TYPE_FP32"`` -> ``np.float32``; raises KeyError for a name with no numpy type."""
    return _STRING_TO_NUMPY[triton_type_string]


def serialize_byte_tensor(input_tensor: npt.NDArray[Any]) -> bytes | tuple[()] | None:
    """Triton's BYTES wire form (4-byte little-endian length, then the bytes; C order).

    As in Triton: ``()`` for an empty array, None when the array holds no bytes/objects.
    """
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type != np.bytes_:
        return None
    return dtypes.serialize_bytes(input_tensor)


def deserialize_bytes_tensor(
    encoded_tensor: bytes | bytearray | memoryview | npt.NDArray[Any],
) -> npt.NDArray[np.object_]:
    """The flat object array of ``bytes`` that Triton's BYTES wire form holds."""
    buffer = encoded_tensor.tobytes() if isinstance(encoded_tensor, np.ndarray) else encoded_tensor
    try:
        return dtypes.deserialize_bytes(buffer)
    except ValueError as exc:
        raise TritonModelException(str(exc)) from None


# -- model management from model code (Triton's BLS model loading API) ----------------------


def load_model(
    model_name: str | bytes, config: str | bytes = "", files: Mapping[str, bytes] | None = None
) -> None:
    """Load (or reload) ``model_name``, optionally with ``config`` (JSON) and the model's
    ``files`` (``"file:<path>"`` -> bytes, which then need ``config``), as Triton's model
    control API does; the server must run with ``--model-control-mode explicit``."""
    try:
        name = arguments.text(model_name, "model_name")
        text = arguments.text(config, "config")
    except arguments.NotText:
        given = {"model_name": model_name, "config": config, "files": files}
        raise arguments.incompatible("load_model", _LOAD_SIGNATURE, given) from None
    _runtime().load_model(name, text, _model_files(name, files))


def _model_files(model_name: str, files: object) -> dict[str, bytes]:
    """Triton's ``files``: None, or a dict of paths (text) to contents (bytes), refused
    with Triton's messages (pybind11's TypeError for a path or content it cannot cast)."""
    if files is None:
        return {}
    if not isinstance(files, Mapping):
        raise TritonModelException(
            f"failed to load model '{model_name}', files should be a dictionary of file paths "
            "and file contents"
        )
    result: dict[str, bytes] = {}
    for path, content in files.items():
        try:
            key = arguments.text(path, "a file path")
        except arguments.NotText:
            raise TypeError(
                f"Object of type '{type(path).__name__}' is not an instance of 'str'"
            ) from None
        if not isinstance(content, bytes):
            raise TypeError(
                f"Object of type '{type(content).__name__}' is not an instance of 'bytes'"
            )
        result[key] = bytes(content)
    return result


def unload_model(model_name: str | bytes, unload_dependents: bool = False) -> None:
    try:
        name = arguments.text(model_name, "model_name")
        dependents = arguments.flag(unload_dependents)
    except arguments.NotText:
        given = {"model_name": model_name, "unload_dependents": unload_dependents}
        raise arguments.incompatible("unload_model", _UNLOAD_SIGNATURE, given) from None
    _runtime().unload_model(name, dependents)


def is_model_ready(model_name: str | bytes, model_version: str | bytes = "") -> bool:
    try:
        name = arguments.text(model_name, "model_name")
        version = arguments.text(model_version, "model_version")
    except arguments.NotText:
        given = {"model_name": model_name, "model_version": model_version}
        raise arguments.incompatible("is_model_ready", _READY_SIGNATURE, given) from None
    return _runtime().is_model_ready(name, version)


_LOAD_SIGNATURE: Final = "(model_name: str, config: str = '', files: object = None) -> None"
_UNLOAD_SIGNATURE: Final = "(model_name: str, unload_dependents: bool = False) -> None"
_READY_SIGNATURE: Final = "(model_name: str, model_version: str = '') -> bool"
