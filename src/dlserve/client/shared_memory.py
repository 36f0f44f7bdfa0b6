"""A drop-in replacement for ``tritonclient.utils.shared_memory``: same functions, same
arguments, same behaviour, plus regions that are context managers::

    from dlserve.client import shared_memory as shm

    with shm.create_shared_memory_region("in", "/in", 1024) as region:
        shm.set_shared_memory_region(region, [array])
        ...                       # register, infer, unregister
    # the object is unmapped and unlinked here, even on an exception

Unlike tritonclient's (built on ``multiprocessing.shared_memory``), nothing is registered
with multiprocessing's resource tracker, so no "leaked shared_memory" warnings at exit and
no object unlinked behind the creator's back when another process that mapped it exits.
"""

from __future__ import annotations

import mmap
import os
import struct
import warnings
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

_SHM_DIR = "/dev/shm"
# key -> {"needs_unlink": bool, "active_handle_count": int}, as tritonclient keeps it
_key_mapping: dict[str, dict[str, Any]] = {}


class SharedMemoryException(Exception):
    """Exception type for shared memory related error."""


class SharedMemoryRegion:
    """A mapped system shared-memory object, and the name it is registered under."""

    def __init__(self, triton_shm_name: str, shm_key: str) -> None:
        self._triton_shm_name = triton_shm_name
        self._shm_key = shm_key
        self._map: mmap.mmap | None = None
        self._size = 0
        self._destroyed = False

    @property
    def name(self) -> str:
        return self._triton_shm_name

    @property
    def key(self) -> str:
        return self._shm_key

    @property
    def byte_size(self) -> int:
        return self._size

    @property
    def buf(self) -> memoryview:
        if self._destroyed:
            raise SharedMemoryException(f"shared memory region '{self._shm_key}' is destroyed")
        return memoryview(self._map) if self._map is not None else memoryview(bytearray())

    def __enter__(self) -> SharedMemoryRegion:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._destroyed:
            destroy_shared_memory_region(self)


def _path(key: str) -> str:
    name = key.lstrip("/")
    if not name or "/" in name:
        raise SharedMemoryException(f"invalid shared memory key '{key}'")
    return os.path.join(_SHM_DIR, name)


def _open(handle: SharedMemoryRegion, byte_size: int, create: bool) -> None:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(_path(handle._shm_key), flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, byte_size)
        handle._size = os.fstat(fd).st_size
        handle._map = mmap.mmap(fd, handle._size) if handle._size else None
    finally:
        os.close(fd)


def create_shared_memory_region(
    triton_shm_name: str, shm_key: str, byte_size: int, create_only: bool = False
) -> SharedMemoryRegion:
    """A handle of the system shared-memory object ``shm_key`` of ``byte_size`` bytes.

    Unless ``create_only``, an object that exists already is mapped as it is (a warning
    says when it is smaller than asked). Raises SharedMemoryException when it cannot be
    created.
    """
    handle = SharedMemoryRegion(triton_shm_name, shm_key)
    created = opened = False
    if not create_only:
        try:
            _open(handle, byte_size, create=False)
            opened = True
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            raise SharedMemoryException("unable to create the shared memory region") from exc
    if not opened:
        try:
            _open(handle, byte_size, create=True)
        except (OSError, ValueError) as exc:
            raise SharedMemoryException("unable to create the shared memory region") from exc
        created = True
    entry = _key_mapping.setdefault(shm_key, {"needs_unlink": False, "active_handle_count": 0})
    entry["needs_unlink"] = entry["needs_unlink"] or created
    entry["active_handle_count"] += 1
    if byte_size > handle._size:
        warnings.warn(
            f"reusing shared memory region with key '{shm_key}', region size is "
            f"{handle._size} instead of requested {byte_size}",
            stacklevel=2,
        )
    return handle


def set_shared_memory_region(
    shm_handle: SharedMemoryRegion, input_values: Any, offset: int = 0
) -> None:
    """Copy the numpy arrays ``input_values`` one after another into the region from
    ``offset``. BYTES arrays must be serialized already (``serialize_byte_tensor``)."""
    if not isinstance(input_values, list | tuple):
        raise SharedMemoryException(
            "input_values must be specified as a list/tuple of numpy arrays"
        )
    for value in input_values:
        if not isinstance(value, np.ndarray):
            raise SharedMemoryException("each element of input_values must be a numpy array")
    try:
        buf = shm_handle.buf
        for value in input_values:
            if value.dtype == np.object_:
                data = value.item()
                buf[offset : offset + len(data)] = data
                offset += len(data)
            else:
                view = np.ndarray(value.shape, value.dtype, buffer=buf[offset:])
                view[...] = value
                offset += value.nbytes
    except Exception as exc:
        raise SharedMemoryException("unable to set the shared memory region") from exc


def get_contents_as_numpy(
    shm_handle: SharedMemoryRegion, datatype: npt.DTypeLike, shape: Any, offset: int = 0
) -> npt.NDArray[Any]:
    """A numpy array over the region's bytes from ``offset`` (a view; BYTES are decoded
    into an object array)."""
    buf = shm_handle.buf
    if datatype != np.object_ and datatype != np.bytes_:
        return np.ndarray(shape, datatype, buffer=buf[offset:])
    count = int(np.prod(shape))
    strings: list[bytes] = []
    position = offset
    for _ in range(max(count, 1)):
        (length,) = struct.unpack_from("<I", buf, position)
        position += 4
        strings.append(bytes(buf[position : position + length]))
        position += length
    return np.array(strings, dtype=object).reshape(shape)


def mapped_shared_memory_regions() -> list[str]:
    """The keys of the objects mapped and not destroyed yet."""
    return list(_key_mapping)


def destroy_shared_memory_region(shm_handle: SharedMemoryRegion) -> None:
    """Unmap the handle; unlink the object when this was its last handle and this process
    created it."""
    if shm_handle._destroyed:
        return
    if shm_handle._map is not None:
        try:
            shm_handle._map.close()
        except BufferError as exc:
            raise SharedMemoryException(
                "unable to destroy the shared memory region: arrays still view it"
            ) from exc
        shm_handle._map = None
    shm_handle._destroyed = True
    entry = _key_mapping.get(shm_handle._shm_key)
    if entry is None:
        return
    entry["active_handle_count"] -= 1
    if entry["active_handle_count"] <= 0:
        _key_mapping.pop(shm_handle._shm_key, None)
        if entry["needs_unlink"]:
            try:
                os.unlink(_path(shm_handle._shm_key))
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise SharedMemoryException("unable to unlink the shared memory region") from exc
