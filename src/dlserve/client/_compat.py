"""The one spelling a published zero-copy guide's client uses that tritonclient does not take.

The guide registers CUDA memory with ``register_cuda_shared_memory(name=...,
cuda_shm_handle=..., device_id=..., byte_size=...)``; tritonclient names that argument
``raw_handle``, so its client raises TypeError against any server. dlserve's drop-in client
modules take both names.
"""

from __future__ import annotations

from typing import Any


def handle_argument(raw_handle: Any, cuda_shm_handle: Any) -> Any:
    """The handle, given once under either name."""
    if (raw_handle is None) == (cuda_shm_handle is None):
        raise TypeError(
            "register_cuda_shared_memory() takes the handle once: raw_handle= or cuda_shm_handle="
        )
    return raw_handle if raw_handle is not None else cuda_shm_handle


def taking_cuda_shm_handle(base: type) -> type:
    """``base`` (a tritonclient InferenceServerClient) whose ``register_cuda_shared_memory``
    also takes the handle as ``cuda_shm_handle=``."""

    def register_cuda_shared_memory(
        self: Any,
        name: str,
        raw_handle: Any = None,
        device_id: int = 0,
        byte_size: int = 0,
        *args: Any,
        cuda_shm_handle: Any = None,
        **kwargs: Any,
    ) -> Any:
        handle = handle_argument(raw_handle, cuda_shm_handle)
        register = base.register_cuda_shared_memory  # type: ignore[attr-defined]
        return register(self, name, handle, device_id, byte_size, *args, **kwargs)

    namespace = {"register_cuda_shared_memory": register_cuda_shared_memory,
                 "__doc__": base.__doc__, "__module__": base.__module__}  # fmt: skip
    return type(base.__name__, (base,), namespace)
