"""GPU helpers for the model side: host copies, stream ordering, the one-time warning.

dlserve needs no CUDA library to run: CUDA is loaded (``tensors/cuda_ipc.py``, through
cuda-python) only when a GPU tensor's bytes are first needed somewhere else.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from dlserve.pb_utils.exceptions import TritonModelException
from dlserve.tensors import cuda_ipc, dlpack

LEGACY_STREAM = cuda_ipc.LEGACY_STREAM
model_name = ""  # the worker's model, named in warnings (set when it loads)
_warned: set[str] = set()
_warn_lock = threading.Lock()


def warn_host_copy_once(name: str) -> None:
    """as_numpy() of a GPU tensor copies; say so once per input or output name."""
    with _warn_lock:
        if name in _warned:
            return
        _warned.add(name)
    sys.stderr.write(
        f"dlserve: model '{model_name}': as_numpy() of GPU tensor '{name}' copies it to host "
        "memory (Triton would raise); use to_dlpack() to keep it on the GPU. This is said "
        "once.\n"
    )


def _cuda_call(what: str, call: Any, *args: Any) -> Any:
    try:
        return call(*args)
    except (cuda_ipc.CudaUnavailable, cuda_ipc.CudaError) as exc:
        raise TritonModelException(f"{what}: {exc}") from None


def copy_to_host(info: dlpack.DLTensorInfo) -> npt.NDArray[Any]:
    """A new C-contiguous host array with the bytes of a compact CUDA tensor."""
    host = np.empty(info.shape, dtype=info.dtype.numpy_storage)
    what = f"copying a GPU tensor (device {info.device_id}) to host memory"
    _cuda_call(what, cuda_ipc.copy, host.ctypes.data, info.ptr, host.nbytes)
    return host


def make_stream_wait(stream: int) -> None:
    """Work queued on ``stream`` from now on waits for CUDA's legacy default stream."""
    _cuda_call("ordering a DLPack consumer's stream", cuda_ipc.make_stream_wait, stream)
