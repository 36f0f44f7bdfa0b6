"""What the SDK accepts as an input (numpy, torch, cupy, anything with ``__dlpack__``) and
what it returns for a GPU output (:class:`DeviceArray`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from dlserve.client import _cuda
from dlserve.tensors import dlpack, dtypes
from dlserve.tensors.dtypes import DType

STREAM_LEGACY = 1  # DLPack: the producer makes its work visible to the legacy default stream


@dataclass(slots=True)
class HostInput:
    name: str
    dtype: DType
    shape: list[int]
    array: npt.NDArray[Any]  # contiguous; BYTES: an object array
    data: memoryview  # the bytes as they go on the wire (BYTES serialized)


@dataclass(slots=True)
class DeviceInput:
    name: str
    dtype: DType
    shape: list[int]
    ptr: int
    nbytes: int
    device: int
    keepalive: object  # the producer's memory stays until the request is sent


def describe(name: str, value: Any) -> HostInput | DeviceInput:
    """One input, wherever it lives; raises ValueError for what cannot be sent."""
    if isinstance(value, np.ndarray) or not hasattr(value, "__dlpack__"):
        return _host(name, np.asarray(value), None)
    info, keepalive = dlpack.import_capsule(value, STREAM_LEGACY)
    if info.device_type != dlpack.CUDA:
        return _host(name, dlpack.host_array(info, keepalive), info.dtype)  # made contiguous
    if info.strides is not None and info.strides != dlpack.compact_strides(info.shape):
        raise ValueError(
            f"GPU input '{name}' is not contiguous (strides {info.strides}): make it "
            "contiguous first (torch: .contiguous(), cupy: cupy.ascontiguousarray)"
        )
    nbytes = int(np.prod(info.shape, dtype=np.int64)) * info.dtype.itemsize
    return DeviceInput(
        name, info.dtype, list(info.shape), info.ptr, nbytes, info.device_id, keepalive
    )


def _host(name: str, array: npt.NDArray[Any], dtype: DType | None) -> HostInput:
    dtype = dtype or dtypes.from_numpy(array.dtype)
    if dtype is None:
        raise ValueError(f"input '{name}': numpy dtype {array.dtype} has no Triton data type")
    if dtype.is_bytes:
        objects = np.asarray(array, dtype=object)
        data = memoryview(dtypes.serialize_bytes(objects))
        return HostInput(name, dtype, list(array.shape), objects, data)
    contiguous = np.ascontiguousarray(array)
    data = contiguous.data.cast("B") if contiguous.size else memoryview(b"")
    return HostInput(name, dtype, list(array.shape), contiguous, data)


class DeviceArray:
    """A tensor in device memory this object owns (freed with it); a DLPack producer
    (``torch.from_dlpack``, ``cupy.from_dlpack``) with ``__cuda_array_interface__`` too."""

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: DType, device: int) -> None:
        self.ptr = ptr
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize

    @classmethod
    def from_host(cls, array: npt.NDArray[Any], dtype: DType, device: int) -> DeviceArray:
        """A device copy of a host array."""
        host = np.ascontiguousarray(array)
        ptr = _cuda.malloc(device, max(host.nbytes, 1))
        tensor = cls(ptr, tuple(host.shape), dtype, device)
        _cuda.copy(ptr, host.ctypes.data, host.nbytes, device)
        return tensor

    @property
    def datatype(self) -> str:
        return self.dtype.wire

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> object:
        # The bytes were copied synchronously: ready on any stream.
        where = (dlpack.CUDA, self.device)
        return dlpack.export_capsule(self.ptr, self.shape, self.dtype, *where, self)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (dlpack.CUDA, self.device)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {
            "shape": self.shape,
            "typestr": self.dtype.numpy_storage.str,
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
        }

    def numpy(self) -> npt.NDArray[Any]:
        """A host copy."""
        host = np.empty(self.shape, dtype=self.dtype.numpy_storage)
        _cuda.copy(host.ctypes.data, self.ptr, self.nbytes, self.device)
        return host

    def __repr__(self) -> str:
        where = f"cuda:{self.device}"
        return f"DeviceArray(shape={self.shape}, datatype={self.datatype}, device={where})"

    def __del__(self) -> None:
        ptr, self.ptr = getattr(self, "ptr", 0), 0
        if ptr:
            try:
                _cuda.free(self.device, ptr)
            except Exception:
                pass  # at interpreter exit the runtime may be gone already
