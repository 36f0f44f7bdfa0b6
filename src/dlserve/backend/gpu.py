"""Host copies of GPU tensors for the model side, through cuda-python when installed.

dlserve needs no CUDA library to run: this module imports ``cuda.bindings`` only
when a GPU tensor's bytes are first needed on the host (the ``gpu`` extra).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from dlserve.backend.errors import TritonModelException
from dlserve.tensors import dlpack

_warned = False
_warn_lock = threading.Lock()


def warn_host_copy_once(name: str) -> None:
    """as_numpy() of a GPU tensor copies; say so once per process."""
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    sys.stderr.write(
        f"dlserve: as_numpy() of GPU tensor '{name}' copies it to host memory (Triton would "
        "raise); use to_dlpack() to keep tensors on the GPU. This is said once.\n"
    )


def _runtime() -> Any:
    try:
        from cuda.bindings import runtime
    except ImportError:
        try:
            from cuda import cudart as runtime  # cuda-python before 12.6
        except ImportError:
            raise TritonModelException(
                "copying a GPU tensor to host memory needs cuda-python (pip install 'dlserve[gpu]')"
            ) from None
    return runtime


def copy_to_host(info: dlpack.DLTensorInfo) -> npt.NDArray[Any]:
    """A new C-contiguous host array with the bytes of a compact CUDA tensor."""
    storage = info.dtype.numpy_storage
    host = np.empty(info.shape, dtype=storage)
    if host.nbytes == 0:
        return host
    runtime = _runtime()
    kind = runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost
    (err,) = runtime.cudaMemcpy(host.ctypes.data, info.ptr, host.nbytes, kind)
    if int(err) != 0:
        raise TritonModelException(
            f"copying a GPU tensor (device {info.device_id}) to host memory failed: {err}"
        )
    return host
