"""A drop-in replacement for ``tritonclient.utils.cuda_shared_memory``: same functions,
same arguments, same behaviour, on cuda.bindings. Added:

- :func:`set_shared_memory_by_cuda_array` ``(handle, device_ptr, byte_size)``: a
  device-to-device copy from a raw CUDA pointer (``tensor.data_ptr()``) into the region;
- regions are context managers: the device memory is freed when the block ends, even on an
  exception (unregister it from the server first, or let the server reclaim it).

cuda-python is imported the first time a function needs it, so importing this module works
anywhere.
"""

from __future__ import annotations

import base64
import struct
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from dlserve.client import _cuda
from dlserve.tensors import dlpack

_STREAM_LEGACY = 1  # DLPack's name for CUDA's legacy default stream, which cudaMemcpy uses


class CudaSharedMemoryException(Exception):
    """A CUDA shared memory call failed."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg)
        self._msg = msg

    def __str__(self) -> str:
        return self._msg


class CudaSharedMemoryRegion:
    """``byte_size`` bytes of device memory on ``device_id`` that other processes may open
    through its IPC handle. Attribute names are tritonclient's."""

    def __init__(
        self, triton_shm_name: str, cuda_shm_handle: Any, base_addr: int, byte_size: int,
        device_id: int,
    ) -> None:  # fmt: skip
        self._triton_shm_name = triton_shm_name
        self._cuda_shm_handle = cuda_shm_handle
        self._base_addr = base_addr
        self._byte_size = byte_size
        self._device_id = device_id
        self._freed = False

    @property
    def name(self) -> str:
        return self._triton_shm_name

    @property
    def byte_size(self) -> int:
        return self._byte_size

    @property
    def device_id(self) -> int:
        return self._device_id

    @property
    def device_ptr(self) -> int:
        return self._base_addr

    def _free(self) -> None:
        if not self._freed:
            self._freed = True
            _cuda.free(self._device_id, self._base_addr)

    def __enter__(self) -> CudaSharedMemoryRegion:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        destroy_shared_memory_region(self)

    def __del__(self) -> None:
        if not getattr(self, "_freed", True):
            try:
                self._free()
            except Exception:
                pass  # at interpreter exit the runtime may be gone already


allocated_shm_regions: list[CudaSharedMemoryRegion] = []


def _wrap(what: str, exc: Exception) -> CudaSharedMemoryException:
    if isinstance(exc, CudaSharedMemoryException):
        return exc
    return CudaSharedMemoryException(f"{what}: {exc}")


def create_shared_memory_region(
    triton_shm_name: str, byte_size: int, device_id: int
) -> CudaSharedMemoryRegion:
    """Allocate ``byte_size`` bytes on ``device_id`` and get their IPC handle."""
    try:
        ptr = _cuda.malloc(device_id, byte_size)
    except Exception as exc:
        raise _wrap("unable to create cuda shared memory handle", exc) from exc
    try:
        handle = _cuda.ipc_handle(ptr)
    except Exception as exc:
        _cuda.free(device_id, ptr)
        raise _wrap("unable to create cuda shared memory handle", exc) from exc
    region = CudaSharedMemoryRegion(triton_shm_name, handle, ptr, byte_size, device_id)
    allocated_shm_regions.append(region)
    return region


def get_raw_handle(cuda_shm_handle: CudaSharedMemoryRegion) -> bytes:
    """The region's serialized cudaIpcMemHandle_t, base64-encoded (what the register call
    takes)."""
    return base64.b64encode(_cuda.ipc_handle_bytes(cuda_shm_handle._cuda_shm_handle))


def _check_room(handle: CudaSharedMemoryRegion, offset: int, byte_size: int) -> None:
    if offset < 0 or byte_size < 0 or offset + byte_size > handle._byte_size:
        raise CudaSharedMemoryException(
            f"{byte_size} bytes at offset {offset} do not fit the {handle._byte_size}-byte "
            f"cuda shared memory region '{handle._triton_shm_name}'"
        )


def set_shared_memory_by_cuda_array(
    cuda_shm_handle: CudaSharedMemoryRegion, device_ptr: int, byte_size: int, offset: int = 0
) -> None:
    """Copy ``byte_size`` bytes from the CUDA address ``device_ptr`` (any device, or host
    memory) into the region at ``offset``; done when this returns."""
    _check_room(cuda_shm_handle, offset, byte_size)
    try:
        _cuda.copy(
            cuda_shm_handle._base_addr + offset,
            int(device_ptr),
            byte_size,
            cuda_shm_handle._device_id,
        )
    except Exception as exc:
        raise _wrap("unable to set values in cuda shared memory", exc) from exc


def set_shared_memory_region(cuda_shm_handle: CudaSharedMemoryRegion, input_values: Any) -> None:
    """Copy the numpy arrays one after another into the region from its start."""
    if not isinstance(input_values, list | tuple):
        raise CudaSharedMemoryException("input_values must be specified as a numpy array")
    for value in input_values:
        if not isinstance(value, np.ndarray):
            raise CudaSharedMemoryException(
                "input_values must be specified as a list/tuple of numpy arrays"
            )
    offset = 0
    for value in input_values:
        array = np.ascontiguousarray(value)
        data: Any = array.item() if array.dtype == np.object_ else array
        size = len(data) if array.dtype == np.object_ else array.nbytes
        host = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
        _check_room(cuda_shm_handle, offset, size)
        try:
            _cuda.copy(
                cuda_shm_handle._base_addr + offset,
                host.ctypes.data,
                size,
                cuda_shm_handle._device_id,
            )
        except Exception as exc:
            raise _wrap("unable to set values in cuda shared memory", exc) from exc
        offset += size


def set_shared_memory_region_from_dlpack(
    cuda_shm_handle: CudaSharedMemoryRegion, input_values: Any
) -> None:
    """Copy DLPack tensors (torch, cupy, numpy ...; contiguous, C order) one after another
    into the region from its start."""
    offset = 0
    for value in input_values:
        info, keepalive = dlpack.import_capsule(value, _STREAM_LEGACY)
        try:
            if info.strides is not None and info.strides != dlpack.compact_strides(info.shape):
                raise CudaSharedMemoryException(
                    "DLPack tensor is not contiguous. Only contiguous DLPack tensors that are "
                    "stored in C-Order are supported."
                )
            size = int(np.prod(info.shape)) * info.dtype.itemsize
            set_shared_memory_by_cuda_array(cuda_shm_handle, info.ptr, size, offset)
        finally:
            del keepalive
        offset += size


def get_contents_as_numpy(
    cuda_shm_handle: CudaSharedMemoryRegion, datatype: npt.DTypeLike, shape: Any
) -> npt.NDArray[Any]:
    """A host copy of the region's contents from its start, as a numpy array."""
    is_bytes = datatype == np.object_ or datatype == np.bytes_
    if is_bytes:
        size = cuda_shm_handle._byte_size
    else:
        size = int(np.prod(shape)) * np.dtype(datatype).itemsize
        if size > cuda_shm_handle._byte_size:
            raise CudaSharedMemoryException(
                "The size of the shared memory region is insufficient to provide numpy array "
                "with requested size"
            )
    host = np.empty(size, dtype=np.uint8)
    try:
        _cuda.copy(host.ctypes.data, cuda_shm_handle._base_addr, size, cuda_shm_handle._device_id)
    except Exception as exc:
        raise _wrap("failed to read cuda shared memory results", exc) from exc
    if not is_bytes:
        return host.view(datatype).reshape(shape)
    strings: list[bytes] = []
    position = 0
    for _ in range(max(int(np.prod(shape)), 1)):
        (length,) = struct.unpack_from("<I", host.data, position)
        strings.append(host[position + 4 : position + 4 + length].tobytes())
        position += 4 + length
    return np.array(strings, dtype=object).reshape(shape)


def as_shared_memory_tensor(
    cuda_shm_handle: CudaSharedMemoryRegion, datatype: str, shape: Any
) -> Any:
    """The region as a DLPack tensor (no copy), as tritonclient's."""
    from tritonclient.utils._shared_memory_tensor import SharedMemoryTensor

    return SharedMemoryTensor(
        datatype, shape, cuda_shm_handle._base_addr, 0, cuda_shm_handle._byte_size,
        cuda_shm_handle._device_id,
    )  # fmt: skip


def allocated_shared_memory_regions() -> list[CudaSharedMemoryRegion]:
    """The regions allocated and not destroyed yet."""
    return allocated_shm_regions


def destroy_shared_memory_region(cuda_shm_handle: CudaSharedMemoryRegion) -> None:
    """Free the region's device memory (once; again is a no-op)."""
    if cuda_shm_handle in allocated_shm_regions:
        allocated_shm_regions.remove(cuda_shm_handle)
    try:
        cuda_shm_handle._free()
    except Exception as exc:
        raise _wrap("unable to free the cuda shared memory region", exc) from exc
