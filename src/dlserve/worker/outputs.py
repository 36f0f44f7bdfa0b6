"""Where a model's outputs go, and the one copy (or none) that takes them there.

An output goes back inline in the reply frame (small), through this worker's output arena
(large), or straight into the client region a request names for it (system or CUDA shared
memory). A GPU output costs one copy to wherever it goes (device-to-device into a CUDA
region, device-to-host elsewhere).

No copy at all: a model may ask for an output's destination before it computes the output
(``pb_utils.get_output_buffer``) and write into it; when it then returns that tensor, its
bytes are already where they must be.
"""

from __future__ import annotations

import json
import math
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from dlserve import pb_utils as pb_utils
from dlserve.ipc import messages as m
from dlserve.pb_utils.exceptions import TritonError
from dlserve.tensors import dtypes
from dlserve.tensors.arena import Arena, buffer_address
from dlserve.worker.bls.gpu_lending import GpuLender
from dlserve.worker.client_regions import ClientRegions
from dlserve.worker.gpu_io import GpuIO

if TYPE_CHECKING:
    from dlserve.worker.runner import Item

# Outputs up to this size travel in the reply frame; larger ones through the arena.
INLINE_OUTPUT_LIMIT = 64 * 1024


@dataclass(slots=True)
class _Buffer:
    name: str  # the output it was handed out for
    nbytes: int
    arena_offset: int  # -1: not in the output arena


class OutputWriter:
    """Puts a model instance's outputs where they go and describes them in its replies."""

    def __init__(self, regions: ClientRegions, arena: Arena, gpu: GpuIO, lender: GpuLender) -> None:
        self.regions = regions
        self.arena = arena
        self.gpu = gpu  # replaced once the instance's device is known
        self.lender = lender  # GPU outputs lent to a BLS caller by handle
        # the output buffers handed out during this execute (all its requests), by address
        self._buffers: dict[int, _Buffer] = {}

    # -- destinations handed out before execute returns ------------------------------------
    def buffer(
        self, targets: dict[str, m.TensorRef], name: str, shape: list[int], dtype: dtypes.DType
    ) -> pb_utils.Tensor:
        """A tensor over the place where output ``name`` must end up."""
        if dtype.is_bytes:
            raise TritonError(f"output '{name}': BYTES outputs have no fixed size to reserve")
        if any(dim < 0 for dim in shape):
            raise TritonError(f"output '{name}': shape {shape} has a negative dimension")
        nbytes = math.prod(shape) * dtype.itemsize
        target = targets.get(name)
        if target is not None:
            _check_room(name, nbytes, target)
        if target is not None and target.where == m.Where.CUDA_REGION:
            tensor = self.gpu.output_buffer(name, shape, dtype, target)
            info = tensor.gpu_info
            assert info is not None
            self._buffers[info.ptr] = _Buffer(name, nbytes, -1)
            return tensor
        offset = -1
        if target is not None:
            view = self.regions.view(_sized(target, nbytes), f"output '{name}'")
        else:
            offset = self.arena.alloc(nbytes) if nbytes else None  # type: ignore[assignment]
            if offset is None:
                offset, view = -1, memoryview(bytearray(nbytes))
            else:
                view = self.arena.view(offset, nbytes)
        array = np.frombuffer(view, dtype=dtype.numpy_storage).reshape(shape)
        self._buffers[int(array.ctypes.data)] = _Buffer(name, nbytes, offset)
        return pb_utils.Tensor._wrap(name, array, dtype)

    def drop_buffers(self) -> None:
        """The request is over: arena space handed out and not returned goes back."""
        if not self._buffers:  # the usual: the model asked for none
            return
        for buffer in self._buffers.values():
            if buffer.arena_offset >= 0:
                self.arena.free(buffer.arena_offset)
        self._buffers.clear()

    def _in_place(self, name: str, data: memoryview | int, nbytes: int) -> _Buffer | None:
        """The buffer handed out for ``name``, if the output (its bytes, or a device
        address) is exactly that buffer. Most requests ask for none: nothing to look up."""
        if not self._buffers:
            return None
        address = data if isinstance(data, int) else buffer_address(data)
        buffer = self._buffers.get(address)
        if buffer is not None and buffer.name == name and buffer.nbytes == nbytes:
            return self._buffers.pop(address)
        return None

    # -- replies ------------------------------------------------------------------------------
    def reply(
        self, item: Item, response: pb_utils.InferenceResponse, settled: AbstractSet[int]
    ) -> tuple[m.InferDone, list[memoryview]]:
        """``item``'s reply carrying ``response``, and the buffers that go inline with it
        (``settled``: as for :meth:`encode`)."""
        refs, buffers, params = self.encode(item, response, settled)
        return m.InferDone(rid=item.rid, outputs=refs, parameters=params), buffers

    def encode(
        self, item: Item, response: pb_utils.InferenceResponse,
        settled: AbstractSet[int] = frozenset(),
    ) -> tuple[list[m.TensorRef], list[memoryview], dict[str, m.ParamValue]]:  # fmt: skip
        """A response's outputs as refs (inline, output arena or client region), the inline
        buffers, and its parameters. ``settled``: the devices whose work was waited for
        since ``execute`` returned (GPU outputs lent on them are not waited for again)."""
        wanted = item.outputs  # a few names: a list is looked through as fast as a set
        targets = {t.name: t for t in item.output_regions} if item.output_regions else None
        refs: list[m.TensorRef] = []
        buffers: list[memoryview] = []
        offset = 0
        for tensor in response.output_tensors():
            if wanted and tensor.name() not in wanted:
                continue
            target = targets.get(tensor.name()) if targets else None
            if item.lend and not tensor.is_cpu() and target is None:  # GPU, to a BLS caller
                lent = self.lender.lend(tensor, self.regions, settled)
                if lent is not None:
                    refs.append(lent)
                    continue
            ref, buffer = self.ref(tensor, offset, target)
            refs.append(ref)
            if buffer is not None:
                buffers.append(buffer)
                offset += buffer.nbytes
        text = response.parameters()
        params = json.loads(text) if text != "{}" else {}
        return refs, buffers, params

    # -- outputs ------------------------------------------------------------------------------
    def ref(
        self, tensor: pb_utils.Tensor, offset: int, target: m.TensorRef | None
    ) -> tuple[m.TensorRef, memoryview | None]:
        """Put ``tensor`` where it goes; its TensorRef, and its bytes when they go inline
        (at ``offset`` of the reply's payload)."""
        info = tensor.gpu_info
        if target is None and info is None:  # the usual: a host tensor, inline or arena
            return self._host_ref(tensor, offset, None)
        name, dtype, shape = tensor.name(), tensor.dtype, tensor.shape()
        if target is not None and target.where == m.Where.CUDA_REGION:
            return self._to_cuda_region(tensor, target), None
        if info is not None:
            nbytes = math.prod(shape) * dtype.itemsize
            if target is not None:
                _check_room(name, nbytes, target)
                written = _sized(target, nbytes)
                view = self.regions.view(written, f"output '{name}'")
                self.regions.pin(written)
                self.gpu.to_host(tensor, view)
                return _described(written, dtype, shape), None
            if nbytes > INLINE_OUTPUT_LIMIT:
                arena_offset = self.arena.alloc(nbytes)
                if arena_offset is not None:
                    self.gpu.pin_output_arena()
                    self.gpu.to_host(tensor, self.arena.view(arena_offset, nbytes))
                    ref = m.TensorRef(name, dtype.wire, shape, m.Where.OUTPUT_ARENA,
                                      arena_offset, nbytes)  # fmt: skip
                    return ref, None
        return self._host_ref(tensor, offset, target)

    def _host_ref(
        self, tensor: pb_utils.Tensor, offset: int, target: m.TensorRef | None
    ) -> tuple[m.TensorRef, memoryview | None]:
        array, name, dtype = tensor.storage, tensor.name(), tensor.dtype
        shape = list(array.shape)
        data = _host_bytes(array, dtype)
        if target is not None:
            return self._to_region(name, dtype, shape, data, target), None
        if data.nbytes > INLINE_OUTPUT_LIMIT:
            buffer = self._in_place(name, data, data.nbytes)
            if buffer is not None and buffer.arena_offset >= 0:  # written where it goes
                arena_offset: int | None = buffer.arena_offset
            else:
                arena_offset = self.arena.alloc(data.nbytes)
                if arena_offset is not None:
                    self.arena.view(arena_offset, data.nbytes)[:] = data
            if arena_offset is not None:
                ref = m.TensorRef(name, dtype.wire, shape, m.Where.OUTPUT_ARENA, arena_offset,
                                  data.nbytes)  # fmt: skip
                return ref, None
        return m.TensorRef(name, dtype.wire, shape, m.Where.PAYLOAD, offset, data.nbytes), data

    def _to_region(self, name: str, dtype: dtypes.DType, shape: list[int], data: memoryview,
                   target: m.TensorRef) -> m.TensorRef:  # fmt: skip
        """The output's one copy (none if it is there already): into a system region."""
        _check_room(name, data.nbytes, target)
        written = _sized(target, data.nbytes)
        if self._in_place(name, data, data.nbytes) is None:
            self.regions.view(written, f"output '{name}'")[:] = data
        return _described(written, dtype, shape)

    def _to_cuda_region(self, tensor: pb_utils.Tensor, target: m.TensorRef) -> m.TensorRef:
        """The output's one copy (none if the model wrote it there): into a CUDA region."""
        name, dtype, shape = tensor.name(), tensor.dtype, tensor.shape()
        info = tensor.gpu_info
        if info is not None:
            source, nbytes = info.ptr, math.prod(shape) * dtype.itemsize
        else:
            data = _host_bytes(tensor.storage, dtype)
            source, nbytes = buffer_address(data), data.nbytes
        _check_room(name, nbytes, target)
        written = _sized(target, nbytes)
        if self._in_place(name, source, nbytes) is None:
            self.gpu.to_cuda_region(name, source, nbytes, written)
        return _described(written, dtype, shape)


def _host_bytes(array: np.ndarray, dtype: dtypes.DType) -> memoryview:
    if dtype.is_bytes:
        return memoryview(dtypes.serialize_bytes(array))
    if array.size and array.flags.c_contiguous:  # the usual: its own buffer, as bytes
        return array.data.cast("B")
    # flat bytes: memoryview cannot cast a view with a zero in its shape
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


def _check_room(name: str, nbytes: int, target: m.TensorRef) -> None:
    if nbytes > target.nbytes:
        raise TritonError(
            f"shared memory size specified with the request for output '{name}' "
            f"({target.nbytes} bytes) should be at least {nbytes} bytes to hold the results",
            TritonError.INTERNAL,
        )


def _sized(target: m.TensorRef, nbytes: int) -> m.TensorRef:
    return msgspec.structs.replace(target, nbytes=nbytes)


def _described(written: m.TensorRef, dtype: dtypes.DType, shape: list[int]) -> m.TensorRef:
    return msgspec.structs.replace(written, datatype=dtype.wire, shape=shape)
