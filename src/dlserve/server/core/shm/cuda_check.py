"""Checking a CUDA shared-memory registration: the handle, the device, the size.

The server opens the client's CUDA IPC handle once, at registration, to learn what it
names (the allocation's size), then closes it: the workers open their own
mappings. This is the only CUDA work the server process does, so it gets a CUDA context
only once a client registers CUDA memory.

Each refusal starts with Triton's message and code (``src/shared_memory_manager.cc``, and
the frontends' register handlers when Triton is built without GPUs), so that clients and
tests that match on them keep working. What Triton only logs follows it (the reason, what
CUDA said, what to do about it), because the client is the one who can act on it.
"""

from __future__ import annotations

from typing import Final

from dlserve import errors
from dlserve.tensors import cuda_ipc

# Triton: the handle does not open (a bad handle, a bad device, no GPU at all).
OPEN_FAILED: Final = "failed to register shared memory region: invalid args"


def size_refused(name: str) -> str:
    """Triton: ``byte_size`` is past the allocation, or its size cannot be asked."""
    return f"failed to register shared memory region '{name}': invalid args"


def not_supported(name: str) -> str:
    """Triton built without GPU support (here: cuda-python is not installed)."""
    return f"failed to register CUDA shared memory region: '{name}', GPUs not supported"


def check_handle_bytes(raw_handle: bytes) -> None:
    """A handle that is not a cudaIpcMemHandle_t's 64 bytes (gRPC carries raw bytes: Triton
    reads 64 from them and fails to open what it read)."""
    if len(raw_handle) != cuda_ipc.HANDLE_SIZE:
        raise errors.InvalidArgumentError(
            f"{OPEN_FAILED}: 'raw_handle' is {len(raw_handle)} bytes, a cudaIpcMemHandle_t "
            f"is {cuda_ipc.HANDLE_SIZE}"
        )


def check_registration(name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
    """Raise a DlserveError unless the handle opens on ``device_id`` and holds
    ``byte_size`` bytes (that the memory is on ``device_id`` cannot be checked: CUDA does
    not say). Blocking (the first open creates a CUDA context): run it off the loop."""
    _check_device(name, device_id)
    try:
        allocation_size = cuda_ipc.allocation_size(raw_handle, device_id)
    except cuda_ipc.CudaError as exc:
        raise _handle_error(name, device_id, exc) from None
    if not 0 <= byte_size <= allocation_size:
        raise errors.InvalidArgumentError(
            f"{size_refused(name)}: byte_size {byte_size} is larger than the allocation "
            f"behind the handle ({allocation_size} bytes)"
        )


def _check_device(name: str, device_id: int) -> None:
    try:
        count = cuda_ipc.device_count()
    except cuda_ipc.CudaUnavailable as exc:
        raise errors.InvalidArgumentError(f"{not_supported(name)}: {exc}") from None
    except cuda_ipc.CudaError as exc:
        raise errors.InvalidArgumentError(f"{OPEN_FAILED}: {exc}") from None
    if not 0 <= device_id < count:
        raise errors.InvalidArgumentError(
            f"{OPEN_FAILED}: GPU {device_id} does not exist; this server sees {count} GPU(s)"
        )


def _handle_error(name: str, device_id: int, exc: cuda_ipc.CudaError) -> errors.DlserveError:
    """What a failed CUDA call while checking the handle means for the client."""
    if exc.call == "cudaIpcOpenMemHandle":
        return errors.InvalidArgumentError(
            f"{OPEN_FAILED}: the CUDA IPC handle of region '{name}' cannot be opened on GPU "
            f"{device_id} ({exc.name}: {exc.text}). A handle opens only in a process that "
            "shares the exporting process's IPC namespace and GPUs, while the exporter is "
            "alive and has not freed the memory: if the client runs in another container, "
            "start both containers with --ipc=host (and the same GPUs visible)."
        )
    if exc.call == "cuMemGetAddressRange":
        return errors.InvalidArgumentError(
            f"{size_refused(name)}: the size of the allocation behind the handle cannot be "
            f"asked ({exc.name}: {exc.text})"
        )
    # Switching devices, closing the handle: the server's trouble, not the client's.
    return errors.InternalError(f"checking the CUDA IPC handle of region '{name}' failed: {exc}")
