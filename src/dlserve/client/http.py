"""A drop-in for ``tritonclient.http``: everything it has, and an InferenceServerClient
whose ``register_cuda_shared_memory`` also takes the handle as ``cuda_shm_handle=`` (the
spelling of a published zero-copy guide's client)."""

from tritonclient.http import *  # noqa: F403 - the drop-in re-exports tritonclient.http
from tritonclient.http import InferenceServerClient as _TritonClient

from dlserve.client._compat import taking_cuda_shm_handle

InferenceServerClient = taking_cuda_shm_handle(_TritonClient)
