"""``pb_utils.Tensor``: a named tensor, exchangeable with any framework by DLPack.

A Tensor made by dlserve for a request input is a view of the bytes the server
delivered (inline in the frame or in the shared-memory arena): ``as_numpy()``
returns that view, not a copy, and writing into it writes into the request's
memory. A Tensor is always C-contiguous, as in Triton.

``from_dlpack`` shares the producer's memory and keeps the producer alive as long
as the Tensor (and anything exported from it) lives. It takes host memory and
CUDA memory; a GPU tensor stays on its device through ``to_dlpack``, and is
copied to the host only when its bytes are needed there (``as_numpy()``, or to
send it as an output).

Differences from Triton, deliberate: ``from_dlpack`` of a non-contiguous *host*
tensor makes a contiguous copy (as ``Tensor(name, array)`` does for arrays)
instead of raising; ``as_numpy()`` of a GPU tensor copies it to the host (with a
one-time warning on stderr) instead of raising.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import numpy.typing as npt

from dlserve.pb_utils import arguments, gpu
from dlserve.pb_utils.exceptions import TritonModelException
from dlserve.tensors import dlpack, dtypes

_SIGNATURE: Final = f"{arguments.MODULE}.Tensor(arg0: str, arg1: numpy.ndarray)"
_FROM_DLPACK: Final = f"(self: str, arg0: object) -> {arguments.MODULE}.Tensor"  # pybind11's
_NOT_CONTIGUOUS = (
    "DLPack tensor is not contiguous. Only contiguous DLPack tensors that are stored in "
    "C-Order are supported."
)


def _resolve_dtype(name: str, array: npt.NDArray[Any], dtype: str | int | None) -> dtypes.DType:
    if dtype is None:
        resolved = dtypes.from_numpy(array.dtype)
    elif isinstance(dtype, str):
        resolved = dtypes.from_wire(dtype) or dtypes.from_config(dtype)
    else:
        resolved = dtypes.BY_CONFIG_CODE.get(int(dtype))
    if resolved is None:
        what = array.dtype if dtype is None else dtype
        raise TritonModelException(f"Tensor '{name}': NumPy dtype is not supported ({what}).")
    return resolved


def _storage_form(name: str, array: npt.NDArray[Any], dtype: dtypes.DType) -> npt.NDArray[Any]:
    """The array as dtype's host storage: objects for BYTES, uint16 bits for BF16."""
    if dtype.is_bytes:
        return array if array.dtype == np.object_ else array.astype(np.object_)
    if array.dtype != dtype.numpy_storage:
        if array.dtype.itemsize != dtype.numpy_storage.itemsize:
            raise TritonModelException(
                f"Tensor '{name}': a {array.dtype} array cannot hold {dtype.wire} data"
            )
        array = array.view(dtype.numpy_storage)
    return array


class Tensor:
    __slots__ = ("_array", "_dtype", "_gpu", "_keepalive", "_name", "_on_legacy_stream")

    def __init__(
        self, name: str | bytes, numpy_array: npt.ArrayLike, dtype: str | int | None = None
    ) -> None:
        """``pb_utils.Tensor(name, numpy_array)``; the name may be bytes (UTF-8).

        ``dtype`` (dlserve's addition: a wire name such as "BF16", or a TYPE_* code)
        reinterprets the array's bytes as that type, e.g. uint16 bit patterns as BF16.
        """
        try:
            if numpy_array is None:
                raise arguments.NotText
            name = arguments.text(name, "Tensor name")
        except arguments.NotText:
            raise arguments.incompatible("__init__", _SIGNATURE, (name, numpy_array)) from None
        if not name:
            raise TritonModelException("Tensor name cannot be an empty string.")
        array = numpy_array if type(numpy_array) is np.ndarray else np.asarray(numpy_array)
        resolved = _resolve_dtype(name, array, dtype)
        if not array.ndim or not array.flags.c_contiguous:  # else ascontiguousarray is a no-op
            array = np.ascontiguousarray(array)
        array = _storage_form(name, array, resolved)
        self._name = name
        self._array: npt.NDArray[Any] | None = array
        self._dtype = resolved
        self._gpu: dlpack.DLTensorInfo | None = None
        self._keepalive: object = None
        self._on_legacy_stream = False

    @classmethod
    def _wrap(cls, name: str, array: npt.NDArray[Any], dtype: dtypes.DType) -> Tensor:
        """Internal: wrap an array already in storage form, without checks or copies."""
        tensor = cls.__new__(cls)
        tensor._name = name
        tensor._array = array
        tensor._dtype = dtype
        tensor._gpu = None
        tensor._keepalive = None
        tensor._on_legacy_stream = False
        return tensor

    @classmethod
    def _wrap_gpu(cls, name: str, info: dlpack.DLTensorInfo, keepalive: object) -> Tensor:
        """Internal: a GPU tensor over memory that is ready now (nothing pending on any
        stream); ``keepalive`` owns the memory."""
        tensor = cls.__new__(cls)
        tensor._name, tensor._dtype, tensor._array = name, info.dtype, None
        tensor._gpu, tensor._keepalive, tensor._on_legacy_stream = info, keepalive, False
        return tensor

    # -- Triton's accessors --------------------------------------------------------------
    def name(self) -> str:
        return self._name

    def as_numpy(self) -> npt.NDArray[Any]:
        if self._dtype.wire == "BF16":
            raise TritonModelException(
                "Tensor dtype is BF16 and cannot be converted to NumPy. Use to_dlpack() and "
                "from_dlpack() instead."
            )
        if self._gpu is not None:
            gpu.warn_host_copy_once(self._name)
        return self.storage

    def shape(self) -> list[int]:
        if self._gpu is not None:
            return list(self._gpu.shape)
        assert self._array is not None
        return list(self._array.shape)

    def triton_dtype(self) -> int:
        return self._dtype.config_code

    def is_cpu(self) -> bool:
        return self._gpu is None

    # -- DLPack --------------------------------------------------------------------------
    def to_dlpack(self) -> object:
        if self._dtype.is_bytes:
            raise TritonModelException("DLPack does not have support for string tensors.")
        info = self._gpu
        if info is not None:
            shape = info.shape
            return dlpack.export_capsule(
                info.ptr, shape, info.dtype, dlpack.CUDA, info.device_id, self
            )
        try:
            return dlpack.capsule_from_array(self.storage, self._dtype)
        except ValueError as exc:
            raise TritonModelException(f"to_dlpack('{self._name}'): {exc}") from None

    def __dlpack__(self, stream: int | None = None, **kwargs: Any) -> object:
        """DLPack's protocol: work the consumer queues on ``stream`` comes after the data
        is ready. Inputs are ready before execute; a tensor imported from a producer is
        ready on CUDA's legacy default stream, so another stream is made to wait on it.
        A legacy capsule is valid for any max_version."""
        if self._on_legacy_stream and stream is not None and stream not in (-1, gpu.LEGACY_STREAM):
            gpu.make_stream_wait(stream)
        return self.to_dlpack()

    def __dlpack_device__(self) -> tuple[int, int]:
        if self._gpu is not None:
            return (dlpack.CUDA, self._gpu.device_id)
        return (dlpack.CPU, 0)

    @classmethod
    def from_dlpack(cls, name: str | bytes, tensor: object) -> Tensor:
        """A Tensor sharing the producer's memory; the producer lives as long as it does."""
        try:
            name = arguments.text(name, "Tensor name")
        except arguments.NotText:
            raise arguments.incompatible("from_dlpack", _FROM_DLPACK, (name, tensor)) from None
        if not name:
            raise TritonModelException("Tensor name cannot be an empty string.")
        if type(tensor) is Tensor:  # a BLS output passed on, say: shared without a capsule
            return tensor._shared(name)
        info, keepalive = _import(name, tensor)
        result = cls.__new__(cls)
        result._name, result._dtype, result._gpu = name, info.dtype, None
        result._keepalive = keepalive
        result._on_legacy_stream = False
        if info.device_type == dlpack.CUDA:
            if info.strides is not None:
                raise TritonModelException(_NOT_CONTIGUOUS)
            result._array, result._gpu = None, info
            result._on_legacy_stream = True
        elif info.device_type in (dlpack.CPU, dlpack.CUDA_HOST):
            array = dlpack.host_array(info, keepalive)
            if info.strides is not None:
                array = np.ascontiguousarray(array)  # a copy: the producer may go now
                result._keepalive = None
            result._array = array
        else:
            raise TritonModelException(
                f"DLDevice type {info.device_type} is not supported by Python backend."
            )
        return result

    def _shared(self, name: str) -> Tensor:
        """``from_dlpack(name, self)`` without the capsule's round trip: the same memory,
        this Tensor kept alive by the new one (so is what it keeps alive: a lent output)."""
        if self._dtype.is_bytes:
            raise TritonModelException("DLPack does not have support for string tensors.")
        result = Tensor.__new__(Tensor)
        result._name, result._dtype, result._gpu = name, self._dtype, self._gpu
        result._keepalive = self
        # as through DLPack: a GPU tensor's pending work is ordered on the legacy stream
        result._on_legacy_stream = self._gpu is not None
        if self._gpu is None:
            assert self._array is not None
            result._array = self._array.view()
        else:
            result._array = None
        return result

    # -- dlserve internals -----------------------------------------------------------------
    @property
    def dtype(self) -> dtypes.DType:
        return self._dtype

    @property
    def gpu_info(self) -> dlpack.DLTensorInfo | None:
        """Where a GPU tensor's bytes are (None for a host tensor)."""
        return self._gpu

    @property
    def storage(self) -> npt.NDArray[Any]:
        """The host array holding the bytes (uint16 for BF16, objects for BYTES).

        For a GPU tensor this is a host copy, made once.
        """
        if self._array is None:
            assert self._gpu is not None
            self._array = gpu.copy_to_host(self._gpu)
        return self._array

    def __repr__(self) -> str:
        where = "cpu" if self._gpu is None else f"cuda:{self._gpu.device_id}"
        return (
            f"Tensor(name={self._name!r}, dtype={self._dtype.wire}, shape={self.shape()}, "
            f"device={where})"
        )


def _import(name: str, tensor: object) -> tuple[dlpack.DLTensorInfo, object]:
    """Consume a capsule, or ask a ``__dlpack__`` producer for one (synchronized)."""
    is_capsule = type(tensor).__name__ == "PyCapsule"
    is_producer = hasattr(tensor, "__dlpack__") and hasattr(tensor, "__dlpack_device__")
    if not is_capsule and not is_producer:
        raise TritonModelException(
            "Provided tensor is not supported. Tensor must be a DLPack capsule or have "
            "`__dlpack__` and `__dlpack_device__` attributes"
        )
    # stream 1 is CUDA's legacy default stream: the producer orders its pending work
    # before it, and the host copy (when one is made) runs on it.
    try:
        return dlpack.import_capsule(tensor, stream=None if is_capsule else 1)
    except (ValueError, TypeError, BufferError) as exc:
        raise TritonModelException(f"from_dlpack('{name}'): {exc}") from None
