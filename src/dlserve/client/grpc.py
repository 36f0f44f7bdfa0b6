"""A drop-in for ``tritonclient.grpc``: everything it has, and an InferenceServerClient
whose ``register_cuda_shared_memory`` also takes the handle as ``cuda_shm_handle=`` (the
spelling of the seeds' client)."""

from __future__ import annotations

from typing import Any

from tritonclient.grpc import *  # noqa: F403 - the drop-in re-exports tritonclient.grpc
from tritonclient.grpc import InferenceServerClient as _TritonClient

from dlserve.client._compat import handle_argument


class InferenceServerClient(_TritonClient):  # type: ignore[misc]
    def register_cuda_shared_memory(
        self,
        name: str,
        raw_handle: Any = None,
        device_id: int = 0,
        byte_size: int = 0,
        *args: Any,
        cuda_shm_handle: Any = None,
        **kwargs: Any,
    ) -> Any:
        handle = handle_argument(raw_handle, cuda_shm_handle)
        return super().register_cuda_shared_memory(
            name, handle, device_id, byte_size, *args, **kwargs
        )
