"""GPU tensors between models (BLS) in the worker: received by CUDA IPC handle, and GPU
outputs lent to a BLS caller by handle instead of being copied to the host.

This runs only on a GPU machine; the ``gpu`` tests in ``tests/e2e/test_bls_gpu.py``
exercise it. The IPC calls go through ``backend.cuda_peers.ipc()``.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from typing import Final

from dlserve import pb_utils as pb_utils
from dlserve.ipc import messages as m
from dlserve.tensors import cuda_ipc, dtypes
from dlserve.worker.bls import cuda_peers
from dlserve.worker.client_regions import ClientRegions


def input_tensor(ref: m.TensorRef) -> pb_utils.Tensor:
    """A CUDA_IPC input: a GPU tensor over the caller's memory (the handle opened once)."""
    base = cuda_peers.ipc().open(ref.handle, ref.device)
    dtype = dtypes.BY_WIRE[ref.datatype]
    info = cuda_peers.gpu_info(base + ref.offset, ref.shape, dtype, ref.device)
    return pb_utils.Tensor._wrap_gpu(ref.name, info, None)


def is_fenced(item: m.Infer | m.BatchItem) -> bool:
    """A direct call whose reply carries fences instead of this worker's waits."""
    return type(item) is m.Infer and item.fenced


def settle_borrowed(items: Iterable[m.Infer | m.BatchItem], every: bool = False) -> set[int]:
    """After ``execute``, before the answer: the model's GPU work is done on the devices of
    its inputs that are not this worker's memory (a client's CUDA region, a BLS caller's
    tensor), on any stream. Their owner may read, reuse or free them once it has the
    answer, and a model that writes into such an input and answers from the host has not
    waited for that work. Fenced direct calls are left out (their replies carry fences,
    :func:`reply_fences`) unless ``every``. Returns the devices waited for (an output lent
    on one of them need not be waited for again). Raises TritonModelException on a CUDA
    error."""
    devices = {ref.device for item in items if every or not is_fenced(item)
               for ref in item.inputs if ref.where in _BORROWED}  # fmt: skip
    for device in devices:
        try:
            cuda_ipc.synchronize_device(device)
        except (cuda_ipc.CudaError, cuda_ipc.CudaUnavailable) as exc:
            raise pb_utils.TritonModelException(
                f"waiting for the model's GPU work on its inputs: {exc}"
            ) from None
    return devices


_BORROWED: Final = (m.Where.CUDA_REGION, m.Where.CUDA_IPC)


def reply_fences(
    item: m.Infer | m.BatchItem, response: pb_utils.InferenceResponse
) -> list[m.Fence]:
    """A fenced direct call's reply: fences over this worker's work on the devices of the
    call's borrowed inputs and of the response's GPU outputs, instead of waiting for it.
    The caller orders its own work after them; what the model left on a non-blocking
    stream of its own it must have waited for, as a DLPack producer must."""
    devices = {ref.device for ref in item.inputs if ref.where in _BORROWED}
    for tensor in response.output_tensors():
        if tensor._gpu is not None:
            devices.add(tensor._gpu.device_id)
    return cuda_peers.fences(devices) if devices else []


class GpuLender:
    """GPU outputs a BLS caller maps by handle; each is kept alive until given back."""

    def __init__(self) -> None:
        self._lent: dict[int, pb_utils.Tensor] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def lend(
        self, tensor: pb_utils.Tensor, regions: ClientRegions, settled: AbstractSet[int]
    ) -> m.TensorRef | None:
        """A CUDA_IPC ref for a GPU output; None when it lies in a client's CUDA region (IPC
        memory cannot be exported again: it goes the usual way, one copy). ``settled``:
        devices waited for since ``execute`` returned (:func:`settle_borrowed`)."""
        info = tensor._gpu
        assert info is not None
        nbytes = tensor.dtype.itemsize * math.prod(info.shape)  # ints: exact
        if regions.locate_cuda(info.ptr, nbytes) is not None:
            return None
        ipc = cuda_peers.ipc()
        found = ipc.find(info.ptr, settled)  # itself received by handle: passed on
        if found is not None:
            handle, device, offset = found
        else:
            handle, offset = ipc.export(info.ptr, info.device_id, info.device_id in settled)
            device = info.device_id
        with self._lock:
            lend_id = next(self._ids)
            self._lent[lend_id] = tensor
        return m.TensorRef(tensor.name(), tensor.dtype.wire, list(info.shape), m.Where.CUDA_IPC,
                           offset, nbytes, handle=handle, device=device, lend=lend_id)  # fmt: skip

    def give_back(self, lend_ids: list[int]) -> None:
        with self._lock:
            for lend_id in lend_ids:
                self._lent.pop(lend_id, None)
