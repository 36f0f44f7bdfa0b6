"""The tensors of a BLS call: inputs by reference where the callee can map them (else
copied once), outputs as views of the callee's memory, lent until they are collected.
Calls through the server (``calls.py``) and straight to the callee (``direct_caller.py``)
share them."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import numpy as np
import numpy.typing as npt

from dlserve.ipc import messages as m
from dlserve.pb_utils.exceptions import TritonError
from dlserve.pb_utils.request import InferenceResponse
from dlserve.pb_utils.tensor import Tensor
from dlserve.tensors import dtypes
from dlserve.worker.bls import cuda_peers

if TYPE_CHECKING:
    from dlserve.worker.link import link

# Gives a lent output back: (the lender's output arena id, offset there or -lend id).
GiveBack = Callable[[int, int], None]


class BlsMemory(Protocol):
    """The worker's shared memory, as BLS calls use it (the worker's ModelRunner)."""

    def locate(self, array: npt.NDArray[Any]) -> m.TensorRef | None:
        """A ref (name, datatype, shape left empty) to ``array``'s bytes when another worker
        can map them where they are (a client's region, this worker's input arena)."""

    def stage(self, data: memoryview) -> m.TensorRef | None:
        """Copy ``data`` once into shared memory another worker can map; None: too small
        (or no room), send it inline."""

    def locate_gpu(self, ptr: int, nbytes: int) -> m.TensorRef | None:
        """A CUDA_REGION ref when GPU memory lies in a client's CUDA region mapped here."""

    def peer_view(self, ref: m.TensorRef) -> memoryview:
        """A view of a PEER_ARENA ref's bytes (another worker's arena, mapped once)."""

    def unstage(self, offset: int) -> None:
        """A staged copy (``stage``) is no longer read: its space goes back."""


def encode_inputs(
    tensors: list[Tensor], memory: BlsMemory | None, fenced: set[int] | None = None
) -> tuple[list[m.TensorRef], list[memoryview]]:
    """Refs to the inputs' bytes: where they are when the callee can map them, else copied
    once into shared memory (large) or into the call's frame (small). GPU inputs are waited
    for (the callee reads them next) unless ``fenced`` is given: their devices are added to
    it, for the caller to send fences over instead."""
    refs: list[m.TensorRef] = []
    payload: list[memoryview] = []
    offset = 0
    for tensor in tensors:
        if tensor._gpu is not None:  # by CUDA IPC handle (GPU-BLS, see cuda_peers)
            refs.append(_gpu_ref(tensor, memory, fenced))
            continue
        array = tensor.storage
        dtype = tensor.dtype
        shape = list(array.shape)
        if not dtype.is_bytes and memory is not None:
            found = memory.locate(array)
            if found is not None:
                refs.append(_named(found, tensor.name(), dtype.wire, shape))
                continue
        if dtype.is_bytes:
            data = memoryview(dtypes.serialize_bytes(array))
        elif array.size and array.flags.c_contiguous:  # the usual: its own buffer, as bytes
            data = array.data.cast("B")
        else:
            data = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data
        staged = memory.stage(data) if memory is not None else None
        if staged is not None:  # the server frees it once the callee is done with it
            refs.append(_named(staged, tensor.name(), dtype.wire, shape))
            continue
        refs.append(
            m.TensorRef(tensor.name(), dtype.wire, shape, m.Where.PAYLOAD, offset, data.nbytes)
        )
        payload.append(data)
        offset += data.nbytes
    return refs, payload


def _gpu_ref(tensor: Tensor, memory: BlsMemory | None, fenced: set[int] | None) -> m.TensorRef:
    """A GPU input travels as its allocation's IPC handle; the caller's request keeps the
    memory alive until the reply (the callee opens each handle once). In a client's CUDA
    region, it travels as that region's handle. Its device's work is waited for, or added
    to ``fenced``."""
    info = tensor._gpu
    assert info is not None
    nbytes = tensor.dtype.itemsize * math.prod(info.shape)  # ints: exact, and no array made
    in_region = memory.locate_gpu(info.ptr, nbytes) if memory is not None else None
    if in_region is not None:
        if fenced is None:
            cuda_peers.synchronize(info.device_id)
        else:
            fenced.add(info.device_id)
        return _named(in_region, tensor.name(), tensor.dtype.wire, list(info.shape))
    ipc = cuda_peers.ipc()
    unwaited = cuda_peers.EVERY_DEVICE if fenced is not None else frozenset()
    found = ipc.find(info.ptr, unwaited)  # received by handle: passed on by the same handle
    if found is not None:
        handle, device, offset = found
    else:
        handle, offset = ipc.export(info.ptr, info.device_id, fenced is not None)
        device = info.device_id
    if fenced is not None:
        fenced.add(device)
    return m.TensorRef(tensor.name(), tensor.dtype.wire, list(info.shape), m.Where.CUDA_IPC,
                       offset, nbytes, handle=handle, device=device)  # fmt: skip


def _named(ref: m.TensorRef, name: str, datatype: str, shape: list[int]) -> m.TensorRef:
    return msgspec.structs.replace(ref, name=name, datatype=datatype, shape=shape)


def response(
    worker: link.WorkerLink, reply: m.BlsReply | m.InferDone, payload: memoryview,
    give_back: GiveBack | None = None,
) -> InferenceResponse:  # fmt: skip
    """The response a BLS call returns; lent outputs go back through ``give_back``
    (the server's, by default)."""
    if reply.error_code:
        return InferenceResponse(error=TritonError(reply.error, triton_code(reply.error_code)))
    back = worker.release_peer if give_back is None else give_back
    fenced = isinstance(reply, m.InferDone) and bool(reply.fences)  # waited for on the GPU
    tensors = [_output_tensor(worker, ref, payload, back, fenced) for ref in reply.outputs]
    return InferenceResponse._received(tensors, reply.parameters)


def _output_tensor(
    worker: link.WorkerLink, ref: m.TensorRef, payload: memoryview, give_back: GiveBack,
    fenced: bool = False,
) -> Tensor:  # fmt: skip
    """An output as a view: of the callee's output arena (mapped here; its space goes back
    when the array and every view of it are gone), or of the reply's own frame. A GPU
    output of a ``fenced`` reply is ready on the legacy stream, not yet on the others."""
    dtype = dtypes.BY_WIRE[ref.datatype]
    if ref.where == m.Where.CUDA_IPC:  # a GPU output, lent until this Tensor is gone
        base = cuda_peers.ipc().open(ref.handle, ref.device)
        info = cuda_peers.gpu_info(base + ref.offset, ref.shape, dtype, ref.device)
        keepalive = _Lent(give_back, ref.region, ref.lend, ref.device)
        tensor = Tensor._wrap_gpu(ref.name, info, keepalive)
        tensor._on_legacy_stream = fenced
        return tensor
    lent = ref.where == m.Where.PEER_ARENA and worker.memory is not None
    if lent:
        assert worker.memory is not None
        raw = worker.memory.peer_view(ref)
    else:
        raw = payload[ref.offset : ref.offset + ref.nbytes]
    if dtype.is_bytes:
        array = dtypes.deserialize_bytes(raw).reshape(ref.shape)
    else:
        array = np.frombuffer(raw, dtype=dtype.numpy_storage).reshape(ref.shape)
    if lent:
        if dtype.is_bytes:  # deserialized: a copy, the arena space can go now
            give_back(ref.region, ref.offset)
        else:
            weakref.finalize(array, give_back, ref.region, ref.offset)
    return Tensor._wrap(ref.name, array, dtype)


def lent_count(reply: m.InferDone) -> int:
    """Outputs of a direct call that stay the callee's until given back."""
    return sum(1 for ref in reply.outputs if ref.where == m.Where.PEER_ARENA
               or (ref.where == m.Where.CUDA_IPC and ref.lend))  # fmt: skip


class _Lent:
    """Held by a Tensor over a lent GPU output: when it goes, the output goes back (a
    ``__del__``: a third of a ``weakref.finalize``'s cost, on every GPU output of a call)."""

    __slots__ = ("device", "give_back", "lend", "region")

    def __init__(self, give_back: GiveBack, region: int, lend: int, device: int) -> None:
        self.give_back, self.region, self.lend, self.device = give_back, region, lend, device

    def __del__(self) -> None:
        try:
            cuda_peers.given_back(self.give_back, self.region, self.lend, self.device)
        except (AttributeError, TypeError):  # the interpreter's teardown: modules are gone,
            pass  # and the connection goes with the process


def triton_code(code: str) -> int:
    for number, name in _CODE_NAMES.items():
        if name == code:
            return number
    return TritonError.INTERNAL


_CODE_NAMES = {
    TritonError.UNKNOWN: "unknown",
    TritonError.INTERNAL: "internal",
    TritonError.NOT_FOUND: "not_found",
    TritonError.INVALID_ARG: "invalid_arg",
    TritonError.UNAVAILABLE: "unavailable",
    TritonError.UNSUPPORTED: "unsupported",
    TritonError.ALREADY_EXISTS: "already_exists",
    TritonError.CANCELLED: "cancelled",
}
