"""A request's inputs as the model gets them: views of the frame, of the input arena, of a
client's system region or a BLS caller's memory, GPU tensors over a client's CUDA region
or a caller's GPU memory; placed as the config asks (``gpu_io``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from dlserve import pb_utils as pb_utils
from dlserve.ipc import messages as m
from dlserve.pb_utils.exceptions import TritonError
from dlserve.tensors import dtypes
from dlserve.tensors.arena import ShmSegment
from dlserve.worker.bls import gpu_lending as gpu_bls
from dlserve.worker.bls.peers import PeerArenas
from dlserve.worker.client_regions import ClientRegions
from dlserve.worker.gpu_io import GpuIO


class InputReader:
    """Turns an input's TensorRef into the tensor the model gets (one per instance)."""

    def __init__(
        self, gpu: GpuIO, regions: ClientRegions, peers: PeerArenas, input_arena: ShmSegment
    ) -> None:
        self.gpu = gpu  # replaced once the instance's device is known
        self.regions = regions
        self.peers = peers
        self.input_arena = input_arena

    def tensor(self, ref: m.TensorRef, payload: memoryview) -> pb_utils.Tensor:
        """Input ``ref`` of a request whose frame carried ``payload``."""
        where = ref.where
        if where == m.Where.PAYLOAD:  # the usual small input: a view of the frame
            dtype = dtypes.BY_WIRE[ref.datatype]
            if not dtype.is_bytes:
                array = np.ndarray(ref.shape, dtype.numpy_storage, payload, ref.offset)
                tensor = pb_utils.Tensor._wrap(ref.name, array, dtype)
                return self.gpu.place(tensor)
        elif where == m.Where.CUDA_REGION:
            return self.gpu.region_input(ref)
        elif where == m.Where.CUDA_IPC:  # a BLS caller's GPU memory
            return gpu_bls.input_tensor(ref)
        tensor = pb_utils.Tensor._wrap(ref.name, *self._array(ref, payload))
        return self.gpu.place(tensor)

    def _array(
        self, ref: m.TensorRef, payload: memoryview
    ) -> tuple[npt.NDArray[Any], dtypes.DType]:
        dtype = dtypes.BY_WIRE[ref.datatype]
        if ref.where == m.Where.PAYLOAD:
            raw = payload[ref.offset : ref.offset + ref.nbytes]
        elif ref.where == m.Where.CLIENT_REGION:  # writable: the model may write into it
            raw = self.regions.view(ref, f"input '{ref.name}'")
            if dtype.is_bytes:
                return _region_bytes(ref, raw), dtype
        elif ref.where == m.Where.PEER_ARENA:  # a BLS caller's memory, by reference
            raw = self.peers.view(ref)
        else:
            raw = self.input_arena.buffer[ref.offset : ref.offset + ref.nbytes]
        if dtype.is_bytes:
            return dtypes.deserialize_bytes(raw).reshape(ref.shape), dtype
        return np.frombuffer(raw, dtype=dtype.numpy_storage).reshape(ref.shape), dtype


def _region_bytes(ref: m.TensorRef, raw: memoryview) -> npt.NDArray[Any]:
    """A BYTES input from a client region, checked here: the server never reads it."""
    try:
        items = dtypes.deserialize_bytes(raw)
    except ValueError as exc:
        raise TritonError(
            f"input '{ref.name}' in shared memory is not valid BYTES data: {exc}",
            TritonError.INVALID_ARG,
        ) from None
    expected = math.prod(ref.shape)
    if items.size != expected:
        raise TritonError(
            f"unexpected number of string elements {items.size} for inference input "
            f"'{ref.name}', expecting {expected}",
            TritonError.INVALID_ARG,
        )
    return items.reshape(ref.shape)
