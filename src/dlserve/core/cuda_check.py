"""Checking a CUDA shared-memory registration: the handle, the device, the size.

The server opens the client's CUDA IPC handle once, at registration, to learn what it
names (the allocation's size and device), then closes it: the workers open their own
mappings. This is the only CUDA work the server process does, so it gets a CUDA context
only once a client registers CUDA memory. CUDA's errors become messages that say what
to do about them.
"""

from __future__ import annotations

from typing import Final

from dlserve import errors
from dlserve.tensors import cuda_ipc

BAD_HANDLE: Final = "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"


def check_handle_bytes(raw_handle: bytes) -> None:
    if len(raw_handle) != cuda_ipc.HANDLE_SIZE:
        raise errors.InvalidArgumentError(BAD_HANDLE)


def check_registration(name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
    """Raise a DlserveError unless the handle opens on ``device_id`` and holds
    ``byte_size`` bytes. Blocking (the first open costs a CUDA context): run it off the
    event loop."""
    prefix = f"failed to register CUDA shared memory region '{name}'"
    try:
        count = cuda_ipc.device_count()
    except cuda_ipc.CudaUnavailable as exc:
        raise errors.UnsupportedError(f"{prefix}: {exc}") from None
    except cuda_ipc.CudaError as exc:
        raise errors.InternalError(f"{prefix}: {exc}") from None
    if not 0 <= device_id < count:
        raise errors.InvalidArgumentError(
            f"{prefix}: GPU {device_id} does not exist; this server sees {count} GPU(s)"
        )
    try:
        allocation = cuda_ipc.inspect_handle(raw_handle, device_id)
    except cuda_ipc.CudaError as exc:
        raise errors.InvalidArgumentError(
            f"{prefix}: its CUDA IPC handle cannot be opened on GPU {device_id} "
            f"({exc.name}: {exc.text}). A handle opens only in a process that shares the "
            "exporting process's IPC namespace and GPUs, while the exporter is alive and "
            "has not freed the memory: if the client runs in another container, start both "
            "containers with --ipc=host (and the same GPUs visible)."
        ) from None
    if allocation.device != device_id:
        raise errors.InvalidArgumentError(
            f"{prefix}: the memory behind the handle is on GPU {allocation.device}, but the "
            f"registration names GPU {device_id}; register it with device_id "
            f"{allocation.device}"
        )
    if not 0 <= byte_size <= allocation.size:
        raise errors.InvalidArgumentError(
            f"{prefix}: byte_size {byte_size} is larger than the allocation behind the "
            f"handle ({allocation.size} bytes)"
        )
