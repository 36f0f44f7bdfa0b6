"""Business Logic Scripting: a model's requests to other models, and model control.

``InferenceRequest.exec()`` sends one typed BlsCall frame to the server, which runs
it as an ordinary request of the callee (validation, instance choice, statistics)
and answers with BlsReply frames. Inputs travel by reference when the caller's
array lies in a client's shared-memory region that both workers can map (the
callee gets a view of the same bytes); any other host tensor travels once, in
the call's frame. Outputs come back in the reply's frame and become views of it.

GPU tensors (for the lead's CUDA IPC path): ``Tensor.storage`` makes a host copy
today; passing them by IPC handle is marked ``GPU-BLS`` below.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import numpy as np
import numpy.typing as npt

from dlserve.backend import cuda_peers, link
from dlserve.backend.errors import TritonError, TritonModelException
from dlserve.backend.tensor import Tensor
from dlserve.ipc import messages as m
from dlserve.ipc.channel import ChannelClosed
from dlserve.tensors import dtypes

if TYPE_CHECKING:
    from dlserve.backend.request import InferenceRequest, InferenceResponse


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


def _worker(what: str) -> link.WorkerLink:
    worker = link.current()
    if worker is None:
        raise TritonModelException(f"{what} is only available inside a model's execute()")
    return worker


# -- requests ------------------------------------------------------------------------------


def _encode_inputs(
    tensors: list[Tensor], memory: BlsMemory | None
) -> tuple[list[m.TensorRef], list[memoryview]]:
    """Refs to the inputs' bytes: where they are when the callee can map them, else copied
    once into shared memory (large) or into the call's frame (small)."""
    refs: list[m.TensorRef] = []
    payload: list[memoryview] = []
    offset = 0
    for tensor in tensors:
        if tensor._gpu is not None:  # by CUDA IPC handle (GPU-BLS, see cuda_peers)
            refs.append(_gpu_ref(tensor, memory))
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


def _gpu_ref(tensor: Tensor, memory: BlsMemory | None) -> m.TensorRef:
    """A GPU input travels as its allocation's IPC handle; the caller's request keeps the
    memory alive until the reply (the callee opens each handle once). In a client's CUDA
    region, it travels as that region's handle."""
    info = tensor._gpu
    assert info is not None
    nbytes = tensor.dtype.itemsize * int(np.prod(info.shape, dtype=np.int64))
    in_region = memory.locate_gpu(info.ptr, nbytes) if memory is not None else None
    if in_region is not None:
        cuda_peers.synchronize(info.device_id)
        return _named(in_region, tensor.name(), tensor.dtype.wire, list(info.shape))
    ipc = cuda_peers.ipc()
    found = ipc.find(info.ptr)  # received by handle itself: passed on by the same handle
    if found is not None:
        handle, device, offset = found
    else:
        handle, offset = ipc.export(info.ptr, info.device_id)
        device = info.device_id
    return m.TensorRef(tensor.name(), tensor.dtype.wire, list(info.shape), m.Where.CUDA_IPC,
                       offset, nbytes, handle=handle, device=device)  # fmt: skip


def _named(ref: m.TensorRef, name: str, datatype: str, shape: list[int]) -> m.TensorRef:
    return msgspec.structs.replace(ref, name=name, datatype=datatype, shape=shape)


def _call_message(request: InferenceRequest, call: int, decoupled: bool) -> m.BlsCall:
    from dlserve.backend.request import InferenceTrace  # request.py imports this module

    params = request.parameters()
    timeout = int(request.timeout() or 0)
    return m.BlsCall(
        call=call,
        model_name=request.model_name(),
        inputs=[],
        outputs=request.requested_output_names(),
        model_version=int(request.model_version()),
        request_id=request.request_id(),
        parameters=json.loads(params) if params != "{}" else {},
        timeout_us=max(timeout, 0),
        decoupled=decoupled,
        correlation_id=request.correlation_id(),
        flags=int(request.flags()),
        trace_id=trace._id if isinstance(trace := request.trace(), InferenceTrace) else 0,
    )


def _send(request: InferenceRequest, decoupled: bool) -> tuple[link.WorkerLink, int]:
    if not request.model_name():
        raise TritonModelException("BLS request needs a model_name")
    worker = _worker("InferenceRequest.exec()")
    refs, payload = _encode_inputs(request.inputs(), worker.memory)
    call = worker.next_call_id()
    msg = _call_message(request, call, decoupled)
    msg.inputs = refs
    msg.chain = [*worker.upstream, worker.model_name]  # this model is upstream of the callee
    worker.open_call(call)
    try:
        worker.send(msg, payload)
    except ChannelClosed:
        worker.close_call(call)
        raise TritonModelException("the connection to the server is closed") from None
    return worker, call


def _next_reply(worker: link.WorkerLink, call: int) -> tuple[m.BlsReply, memoryview]:
    """The next answer to ``call``. The server always answers (an error at worst)."""
    try:
        answer = worker.wait_answer(call, None)
    except ChannelClosed:
        raise TritonModelException("the connection to the server is closed") from None
    assert answer is not None and isinstance(answer[0], m.BlsReply)
    return answer[0], answer[1]


def _response(worker: link.WorkerLink, reply: m.BlsReply, payload: memoryview) -> InferenceResponse:
    from dlserve.backend.request import InferenceResponse

    if reply.error_code:
        return InferenceResponse(error=TritonError(reply.error, _triton_code(reply.error_code)))
    tensors = [_output_tensor(worker, ref, payload) for ref in reply.outputs]
    return InferenceResponse(tensors, parameters=reply.parameters or None)


def _output_tensor(worker: link.WorkerLink, ref: m.TensorRef, payload: memoryview) -> Tensor:
    """An output as a view: of the callee's output arena (mapped here; its space goes back
    when the array and every view of it are gone), or of the reply's own frame."""
    dtype = dtypes.BY_WIRE[ref.datatype]
    if ref.where == m.Where.CUDA_IPC:  # a GPU output, lent until this Tensor is gone
        base = cuda_peers.ipc().open(ref.handle, ref.device)
        info = cuda_peers.gpu_info(base + ref.offset, ref.shape, dtype, ref.device)
        keepalive = _Lent()
        weakref.finalize(keepalive, worker.release_peer, ref.region, -ref.lend)
        return Tensor._wrap_gpu(ref.name, info, keepalive)
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
            worker.release_peer(ref.region, ref.offset)
        else:
            weakref.finalize(array, worker.release_peer, ref.region, ref.offset)
    return Tensor._wrap(ref.name, array, dtype)


class _Lent:
    """Held by a Tensor over a lent GPU output: when it goes, the output goes back."""


def _triton_code(code: str) -> int:
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


class ResponseIterator:
    """The responses of a BLS call to a decoupled model, the empty final one included.

    The server forwards them as they come (not held back by what this iterator has taken:
    core/bls.py says why); cancelling it, or its being collected unfinished, ends the
    callee's request."""

    def __init__(self, worker: link.WorkerLink, call: int, inputs: list[Tensor]) -> None:
        self._worker = worker
        self._call = call
        self._done = False
        self._inputs = inputs  # the callee may read the caller's memory until the end

    def __iter__(self) -> ResponseIterator:
        return self

    def __next__(self) -> InferenceResponse:
        if self._done:
            raise StopIteration
        reply, payload = _next_reply(self._worker, self._call)
        if reply.final:
            self._done = True
            self._inputs = []
            self._worker.close_call(self._call)
        return _response(self._worker, reply, payload)

    def _credit(self, msg: m.BlsCredit) -> None:
        with contextlib.suppress(ChannelClosed):  # the server is gone: nothing to tell
            self._worker.send(msg)

    def cancel(self) -> None:
        """Stop listening: responses still coming are dropped, and the callee's request
        is cancelled (it sees ``is_cancelled()``)."""
        if not self._done:
            self._done = True
            self._worker.close_call(self._call)
            self._credit(m.BlsCredit(self._call, stop=True))

    def __del__(self) -> None:
        if not self._done:
            self._worker.close_call(self._call)
            self._worker.stop_call_later(self._call)


def execute(request: InferenceRequest, decoupled: bool) -> InferenceResponse | ResponseIterator:
    worker, call = _send(request, decoupled)
    if decoupled:
        return ResponseIterator(worker, call, request.inputs())
    try:
        reply, payload = _next_reply(worker, call)
    finally:
        worker.close_call(call)
    return _response(worker, reply, payload)


async def async_execute(
    request: InferenceRequest, decoupled: bool
) -> InferenceResponse | ResponseIterator:
    """As :func:`execute`; the wait runs in a thread so the model's loop goes on."""
    worker, call = _send(request, decoupled)
    if decoupled:
        return ResponseIterator(worker, call, request.inputs())
    try:
        reply, payload = await asyncio.to_thread(_next_reply, worker, call)
    finally:
        worker.close_call(call)
    return _response(worker, reply, payload)


# -- model control -------------------------------------------------------------------------


def control(op: str, model_name: str, **fields: Any) -> bool:
    """``is_model_ready`` / ``load_model`` / ``unload_model``: ask the server, wait."""
    worker = _worker(f"pb_utils.{_OP_NAMES[op]}")
    call = worker.next_call_id()
    worker.open_call(call)
    try:
        worker.send(m.ControlCall(call=call, op=op, model_name=model_name, **fields))
        answer = worker.wait_answer(call, time.monotonic() + _CONTROL_TIMEOUT_S)
    except ChannelClosed:
        raise TritonModelException("the connection to the server is closed") from None
    finally:
        worker.close_call(call)
    if answer is None:
        raise TritonModelException(
            f"pb_utils.{_OP_NAMES[op]}: the server did not answer in {_CONTROL_TIMEOUT_S:g} s"
        )
    reply = answer[0]
    assert isinstance(reply, m.ControlReply)
    if reply.error_code:
        raise TritonModelException(reply.error)
    return reply.ready


_OP_NAMES = {"ready": "is_model_ready", "load": "load_model", "unload": "unload_model"}
_CONTROL_TIMEOUT_S = 600.0
