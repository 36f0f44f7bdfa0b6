"""The few CUDA runtime calls the client needs, through cuda.bindings (cuda-python).

Imported lazily: nothing here runs unless a GPU tensor or a CUDA region is used, so the
SDK works without cuda-python and without a GPU.
"""

from __future__ import annotations

import ctypes
from typing import Any


class CudaError(RuntimeError):
    """A CUDA runtime call failed."""


def runtime() -> Any:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise CudaError("CUDA shared memory needs cuda-python: pip install 'dlserve[gpu]'") from exc
    return cudart


def call(name: str, *args: Any) -> Any:
    """``cudart.<name>(*args)``, its error raised as CudaError; its result (if any)."""
    cudart = runtime()
    result = getattr(cudart, name)(*args)
    error = result[0]
    if error != cudart.cudaError_t.cudaSuccess:
        _, text = cudart.cudaGetErrorString(error)
        raise CudaError(f"{name} failed: {text.decode() if isinstance(text, bytes) else text}")
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


class on_device:
    """Make ``device`` current for a block; the previous device is current again after."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.previous: int | None = None

    def __enter__(self) -> None:
        self.previous = int(call("cudaGetDevice"))
        if self.previous != self.device:
            call("cudaSetDevice", self.device)

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None and self.previous != self.device:
            call("cudaSetDevice", self.previous)


def malloc(device: int, byte_size: int) -> int:
    with on_device(device):
        return int(call("cudaMalloc", byte_size))


def free(device: int, ptr: int) -> None:
    with on_device(device):
        call("cudaFree", ptr)


def ipc_handle(ptr: int) -> Any:
    return call("cudaIpcGetMemHandle", ptr)


def ipc_handle_bytes(handle: Any) -> bytes:
    """The raw bytes of a cudaIpcMemHandle_t (64 of them)."""
    cudart = runtime()
    return bytes((ctypes.c_char * cudart.CUDA_IPC_HANDLE_SIZE).from_address(handle.getPtr()))


def copy(dst: int, src: int, byte_size: int, device: int) -> None:
    """Copy between any two addresses (unified addressing tells the kinds), on ``device``'s
    legacy default stream, and wait for it: cudaMemcpy alone may return before a
    device-to-device or pageable host-to-device copy is done, and another process (the
    server's worker) reads the destination next, on a stream of its own."""
    if byte_size:
        cudart = runtime()
        with on_device(device):
            call("cudaMemcpy", dst, src, byte_size, cudart.cudaMemcpyKind.cudaMemcpyDefault)
            call("cudaStreamSynchronize", cudart.cudaStreamLegacy)
