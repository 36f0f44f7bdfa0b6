"""GPU tensors between models (BLS) by CUDA IPC handle: the interface, and a small
implementation on cuda-python.

FOR THE LEAD (GPU-BLS): this is written against :class:`CudaIpc`, the four calls BLS
needs. The lead's ``tensors/cuda_ipc.py`` (worker-side IPC mappings for CUDA shared
memory) should provide them; then :func:`ipc` returns that implementation and
:class:`_DriverIpc` below can go. Untested here (no GPU): the ``gpu`` tests in
``tests/e2e/test_bls_gpu.py`` exercise it.

A sender exports the allocation that holds a pointer (``cuMemGetAddressRange`` gives
its base, ``cuIpcGetMemHandle`` its handle) and sends (handle, offset). A receiver
opens each handle once and keeps it open (an open costs ~470 us on an H200), so a
pointer is ``base + offset``. The sender keeps the memory alive until the receiver's
response is back (inputs) or until the receiver gives it back (outputs).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from dlserve.backend.errors import TritonModelException
from dlserve.tensors import dlpack


class CudaIpc(Protocol):
    def export(self, ptr: int, device: int) -> tuple[bytes, int]:
        """The IPC handle of the allocation holding ``ptr``, and ``ptr``'s offset in it.
        Waits for the work queued on the device (the receiver reads from another process)."""

    def open(self, handle: bytes, device: int) -> int:
        """The base address of an exported allocation in this process (opened once)."""

    def find(self, ptr: int) -> tuple[bytes, int, int] | None:
        """(handle, device, offset) when ``ptr`` lies in an allocation opened here: a
        tensor received by handle is passed on by the same handle."""

    def close_all(self) -> None: ...


_ipc: CudaIpc | None = None
_lock = threading.Lock()


def ipc() -> CudaIpc:
    """The process's CUDA IPC implementation; raises when cuda-python is missing."""
    global _ipc
    with _lock:
        if _ipc is None:
            _ipc = _DriverIpc()
        return _ipc


def gpu_info(ptr: int, shape: list[int], dtype: Any, device: int) -> dlpack.DLTensorInfo:
    return dlpack.DLTensorInfo(ptr, tuple(shape), None, dtype, dlpack.CUDA, device, False)


class _DriverIpc:
    """CudaIpc on cuda-python (``cuda.bindings``)."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver, runtime
        except ImportError:
            raise TritonModelException(
                "GPU tensors between models need cuda-python (pip install 'dlserve[gpu]')"
            ) from None
        self._driver: Any = driver
        self._runtime: Any = runtime
        self._opened: dict[bytes, tuple[int, int, int]] = {}  # handle -> (base, size, device)
        self._exported: dict[bytes, int] = {}  # handle -> base, of this process's allocations
        self._lock = threading.Lock()

    def _check(self, result: Any, what: str) -> Any:
        err, *values = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            raise TritonModelException(f"{what} failed: {err}")
        return values[0] if len(values) == 1 else values

    def export(self, ptr: int, device: int) -> tuple[bytes, int]:
        rt, drv = self._runtime, self._driver
        self._check(rt.cudaSetDevice(device), "cudaSetDevice")
        self._check(rt.cudaStreamSynchronize(0), "cudaStreamSynchronize")
        base, _size = self._check(drv.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
        handle = bytes(self._check(drv.cuIpcGetMemHandle(base), "cuIpcGetMemHandle").reserved)
        with self._lock:
            self._exported[handle] = int(base)
        return handle, ptr - int(base)

    def open(self, handle: bytes, device: int) -> int:
        with self._lock:
            found = self._opened.get(handle)
            if found is not None:
                return found[0]
            if handle in self._exported:  # our own memory, back from a callee or caller
                return self._exported[handle]
            rt, drv = self._runtime, self._driver
            self._check(rt.cudaSetDevice(device), "cudaSetDevice")
            native = drv.CUipcMemHandle()
            native.reserved = handle
            flags = drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
            base = int(self._check(drv.cuIpcOpenMemHandle(native, flags), "cuIpcOpenMemHandle"))
            _, size = self._check(drv.cuMemGetAddressRange(base), "cuMemGetAddressRange")
            self._opened[handle] = (base, int(size), device)
            return base

    def find(self, ptr: int) -> tuple[bytes, int, int] | None:
        with self._lock:
            for handle, (base, size, device) in self._opened.items():
                if base <= ptr < base + size:
                    return handle, device, ptr - base
        return None

    def close_all(self) -> None:
        with self._lock:
            for base, _, _ in self._opened.values():
                self._driver.cuIpcCloseMemHandle(base)
            self._opened.clear()
