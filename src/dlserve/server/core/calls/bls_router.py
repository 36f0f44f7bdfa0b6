"""Calls from model code (BLS): run as ordinary requests of the callee, answered in frames.

A worker's BlsCall becomes an :class:`InferRequest` that goes through the same path as a
client's (the request pipeline, ``server/core/pipeline.py``: version lookup, validation,
instance choice, statistics); its responses go back to the caller as BlsReply frames. The
call chain (the instances upstream of the call, ``m.chain_entry``) travels with it: the
callee's scheduler never gives it one of those instances (each waits for this call), and a
call into a model whose every instance is in its chain is refused at once, since it could
only wait for itself; any other call, a model calling itself included, is served. A call's
``timeout`` (microseconds, as Triton's) is the callee's request timeout, as a client's
``timeout`` is (its queue policy applies it; the model reads it in ``request.timeout()``);
it also bounds the caller's wait: past it the caller gets Triton's "Request timeout
expired", and the callee's request runs to its end (it may be reading the caller's memory),
its answer dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Coroutine
from typing import TYPE_CHECKING, Any

from dlserve import errors
from dlserve.ipc import messages as m
from dlserve.server.core.calls.direct_broker import DirectLinks
from dlserve.server.core.instances.handle import DirectMessage, WorkerHandle
from dlserve.server.core.instances.lending import ARENA_OWNERS, return_lent
from dlserve.server.core.models.versions import ModelVersion
from dlserve.server.core.scheduling.scheduler import TIMEOUT
from dlserve.server.core.scheduling.sequence_config import (
    FLAG_END,
    FLAG_START,
    SEQUENCE_END,
    SEQUENCE_ID,
    SEQUENCE_START,
)
from dlserve.server.core.streaming import Call, StreamItem
from dlserve.types import (
    ArenaSpan,
    CudaSpan,
    InferRequest,
    InferResponse,
    InputTensor,
    ParamValue,
    RegionRef,
    RequestedOutput,
)

if TYPE_CHECKING:
    from dlserve.server.core.service import InferenceService
    from dlserve.server.core.telemetry.tracer import Trace

log = logging.getLogger("dlserve.bls")

_NOT_DECOUPLED_CALL = (
    "Model {name} is using the decoupled. The current BLS request call doesn't support models "
    "using the decoupled transaction policy. Please use 'decoupled=True' argument to the "
    "'exec' or 'async_exec' calls for decoupled models."
)


_NOT_READY = "Failed for execute the inference request. Model '{name}' is not ready."  # Triton's


def cycle_error(chain: list[str], callee: ModelVersion) -> errors.DlserveError | None:
    """The refusal of a call that no instance of its callee could run: every one is
    upstream of it in its call chain, waiting (directly or not) for this very call."""
    pool = callee.pool
    if not chain or pool is None:
        return None
    held = set(chain)
    if not all(entry in held for entry in pool.chain_entries):
        return None
    name = callee.name
    path = " -> ".join([*(m.chain_model(entry) for entry in chain), name])
    count = len(pool.chain_entries)
    return errors.UnavailableError(
        f"circular BLS call {path}: every instance of model '{name}' ({count}) is already "
        "waiting on this call chain, so the call could only wait for itself; dlserve "
        "refuses it instead of deadlocking"
    )


class BlsRouter:
    """The core's side of workers' calls (``workers.client.CallSink``)."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service
        self.direct = DirectLinks(service)  # calls from one worker straight to another
        self._tasks: set[asyncio.Task[None]] = set()
        self._streams: dict[tuple[int, int], _Answer] = {}  # decoupled calls, by (caller, call)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- BLS ------------------------------------------------------------------------------
    def on_bls(self, caller: WorkerHandle, msg: m.BlsCall, payload: memoryview) -> None:
        self._spawn(self._serve(caller, msg, payload))

    def on_direct(self, worker: WorkerHandle, msg: DirectMessage) -> None:
        self.direct.on_frame(worker, msg)

    def on_bls_credit(self, caller: WorkerHandle, msg: m.BlsCredit) -> None:
        """The caller of a decoupled call stopped listening: the callee's request ends."""
        answer = self._streams.get((id(caller), msg.call))
        if answer is not None and msg.stop:
            answer.stopped = True

    async def _serve(self, caller: WorkerHandle, msg: m.BlsCall, payload: memoryview) -> None:
        """Answer one call. Past its timeout the caller gets an error at once; the callee's
        request goes on (it may still read the caller's memory) and what it returns late
        is released, as are the inputs the caller staged, once it is over."""
        answer = _Answer(caller, msg.call)
        staged = [r.offset for r in msg.inputs if r.where == m.Where.OUTPUT_ARENA]
        try:
            self._check_callee(msg)
            request, call = self._request(caller, msg, payload)
            if msg.timeout_us <= 0:  # the common case: no extra task on the way
                await self._run(request, call, msg, answer)
                caller.release_staged(staged)
                return
            work = asyncio.ensure_future(self._run(request, call, msg, answer))
            done, _ = await asyncio.wait({work}, timeout=msg.timeout_us / 1e6)
            if not done:
                answer.fail(errors.UnavailableError("Request timeout expired"))
                answer.late = True
                self._spawn(_finish_late(work, caller, staged))
                return
            work.result()
        except errors.DlserveError as exc:
            answer.fail(exc)
        except Exception as exc:  # a bug: the caller must not wait forever
            log.exception("BLS call to model '%s' failed", msg.model_name)
            answer.fail(errors.InternalError(str(exc)))
        caller.release_staged(staged)

    def _check_callee(self, msg: m.BlsCall) -> None:
        """A call to a model (or version) the server does not serve fails with Triton's
        message; a call that no instance could run is refused (``cycle_error``)."""
        version = "" if msg.model_version < 0 else str(msg.model_version)
        try:
            loaded = self.service.version(msg.model_name, version)
        except errors.DlserveError as exc:
            raise type(exc)(_NOT_READY.format(name=msg.model_name)) from None
        refused = cycle_error(msg.chain, loaded)
        if refused is not None:
            raise refused

    async def _run(
        self, request: InferRequest, call: Call, msg: m.BlsCall, answer: _Answer
    ) -> None:
        # trace=request.trace() of a traced request: a child of the caller's trace
        parent = self.service.tracer.live.get(msg.trace_id) if msg.trace_id else None
        trace = parent.child(request.model_name) if parent is not None else None
        try:
            await self._answer(request, call, msg, answer, trace)
        finally:
            if trace is not None:
                trace.release()

    async def _answer(
        self, request: InferRequest, call: Call, msg: m.BlsCall, answer: _Answer,
        trace: Trace | None,
    ) -> None:  # fmt: skip
        if not msg.decoupled:
            loaded = self.service.version(request.model_name, request.model_version)
            if loaded.decoupled:
                raise errors.UnsupportedError(_NOT_DECOUPLED_CALL.format(name=request.model_name))
            answer.send(await self.service.infer(request, call, trace), None, True)
            return
        key = (id(answer.caller), answer.call)
        self._streams[key] = answer  # its caller gives credit back as it takes responses
        try:
            await _forward(self.service.infer_stream(request, call, trace), answer)
        finally:
            del self._streams[key]

    def _request(
        self, caller: WorkerHandle, msg: m.BlsCall, payload: memoryview
    ) -> tuple[InferRequest, Call]:
        inputs: list[InputTensor] = []
        spans: dict[str, tuple[int, int, int]] = {}
        arenas: dict[str, ArenaSpan | CudaSpan] = {}
        for ref in msg.inputs:
            shape = tuple(ref.shape)
            if ref.where == m.Where.PAYLOAD:
                data = payload[ref.offset : ref.offset + ref.nbytes]
                inputs.append(InputTensor(ref.name, ref.datatype, shape, data))
                continue
            # by reference: the callee maps the caller's memory (sized for validation)
            region = RegionRef("", ref.nbytes, ref.offset)
            inputs.append(InputTensor(ref.name, ref.datatype, shape, None, {}, region))
            if ref.where in (m.Where.CLIENT_REGION, m.Where.CUDA_REGION):  # a client's region
                spans[ref.name] = (ref.region, ref.offset, ref.nbytes)
            elif ref.where in (m.Where.INPUT_ARENA, m.Where.OUTPUT_ARENA):
                arenas[ref.name] = caller.arena_span(ref.where, ref.offset, ref.nbytes)
            elif ref.where == m.Where.PEER_ARENA:  # a callee's output the caller passes on
                arenas[ref.name] = _peer_span(ref)
            elif ref.where == m.Where.CUDA_IPC:  # GPU memory the caller keeps until the reply
                arenas[ref.name] = CudaSpan(ref.handle, ref.device, ref.offset, ref.nbytes)
            else:
                raise errors.InvalidArgumentError(f"BLS input '{ref.name}' has no data")
        lease = self.service.regions.lease_spans(spans, arenas) if spans or arenas else None
        version = "" if msg.model_version < 0 else str(msg.model_version)
        request = InferRequest(
            msg.model_name, version, msg.request_id, inputs,
            [RequestedOutput(name) for name in msg.outputs], _parameters(msg),
        )  # fmt: skip
        return request, Call(tuple(msg.chain), lease, lend=True)

    # -- model control --------------------------------------------------------------------
    def on_control(self, caller: WorkerHandle, msg: m.ControlCall) -> None:
        self._spawn(self._control(caller, msg))

    async def _control(self, caller: WorkerHandle, msg: m.ControlCall) -> None:
        reply = m.ControlReply(call=msg.call)
        try:
            if msg.op == "ready":
                reply.ready = self.service.model_ready(msg.model_name, msg.model_version)
            elif msg.op == "load":
                await self.service.repository_api.load(
                    msg.model_name, msg.config or None, msg.files or None
                )
            elif msg.op == "unload":
                await self.service.repository_api.unload(msg.model_name)
            else:
                raise errors.InvalidArgumentError(f"unknown model control call '{msg.op}'")
        except errors.DlserveError as exc:
            reply.error, reply.error_code = exc.message, exc.code.value
        caller.send_answer(reply, [])


def _peer_span(ref: m.TensorRef) -> ArenaSpan:
    owner = ARENA_OWNERS.get(ref.region)
    if owner is None or ref.region not in owner.arena_ids:
        raise errors.UnavailableError(
            f"BLS input '{ref.name}' is the output of a model instance that is gone"
        )
    index = owner.arena_ids.index(ref.region)
    span = owner.arena_span(m.Where.INPUT_ARENA if index == 0 else m.Where.OUTPUT_ARENA,
                            ref.offset, ref.nbytes)  # fmt: skip
    return span


async def _forward(items: AsyncGenerator[StreamItem, None], answer: _Answer) -> None:
    """A decoupled callee's responses to its caller as they come: when the caller stops
    listening (or dies) the callee's request is cancelled.

    Not held back by how many the caller has taken, unlike a network client's: a caller
    that reads its calls in another order than it made them (two calls to one instance,
    zipped) would otherwise wait for a callee waiting for it. The caller is model code in
    this server; what it leaves unread stays with it, as in Triton."""
    async with contextlib.aclosing(items):
        async for item in items:
            if answer.stopped or answer.caller.closed.done():
                _return_lent(item.response)
                return
            answer.send(item.response, item.error, item.final)


async def _finish_late(work: asyncio.Future[None], caller: WorkerHandle, staged: list[int]) -> None:
    """A call answered by its timeout: wait for the callee, then free what it held."""
    with contextlib.suppress(Exception):
        await work
    caller.release_staged(staged)


class _Answer:
    """The BlsReply frames of one call: outputs inline (small) or lent (the callee's
    output arena, mapped by the caller); after a timeout, late responses are dropped."""

    def __init__(self, caller: WorkerHandle, call: int) -> None:
        self.caller = caller
        self.call = call
        self.finished = False
        self.late = False
        self.stopped = False  # the caller stopped listening

    def fail(self, error: errors.DlserveError) -> None:
        if not self.finished:
            self.send(None, error, True)

    def send(
        self, response: InferResponse | None, error: errors.DlserveError | None, final: bool
    ) -> None:
        if self.late or self.finished:
            _return_lent(response)
            return
        self.finished = final
        caller = self.caller
        if error is not None:
            reply = m.BlsReply(self.call, error=error.message, error_code=error.code.value)
            reply.final = final
            caller.send_answer(reply, [])
            return
        if response is None:
            caller.send_answer(m.BlsReply(self.call, final=final, has_response=False), [])
            return
        refs, payload = _output_refs(caller, response)
        reply = m.BlsReply(self.call, refs, final=final, parameters=dict(response.parameters))
        caller.send_answer(reply, payload)


def _output_refs(
    caller: WorkerHandle, response: InferResponse
) -> tuple[list[m.TensorRef], list[memoryview]]:
    refs: list[m.TensorRef] = []
    payload: list[memoryview] = []
    offset = 0
    for output in response.outputs:
        shape = list(output.shape)
        lent = output.lent
        if isinstance(lent, CudaSpan):  # by IPC handle; the caller gives it back
            caller.borrow(lent)
            ref = m.TensorRef(output.name, output.datatype, shape, m.Where.CUDA_IPC,
                              lent.offset, lent.byte_size, lent.owner, handle=lent.handle,
                              device=lent.device, lend=lent.lend_id)  # fmt: skip
            refs.append(ref)
            continue
        if lent is not None:  # a view for the caller; it gives the space back
            caller.borrow(lent)
            where = m.Where.PEER_ARENA
            ref = m.TensorRef(output.name, output.datatype, shape, where, lent.offset,
                              lent.byte_size, lent.arena_id, lent.path)  # fmt: skip
            refs.append(ref)
            continue
        data = memoryview(output.data if output.data is not None else b"")
        refs.append(m.TensorRef(output.name, output.datatype, shape, m.Where.PAYLOAD, offset,
                                data.nbytes))  # fmt: skip
        payload.append(data)
        offset += data.nbytes
    return refs, payload


def _return_lent(response: InferResponse | None) -> None:
    """Outputs nobody will map: their space goes back to the callee at once."""
    if response is not None:
        return_lent(response.outputs)


def _parameters(msg: m.BlsCall) -> dict[str, ParamValue]:
    """A BLS request's parameters, with its timeout, correlation id and flags as a client
    would send them (the callee's scheduler takes them out again)."""
    params: dict[str, ParamValue] = dict(msg.parameters)
    if msg.timeout_us > 0:
        params[TIMEOUT] = msg.timeout_us
    if msg.correlation_id or msg.flags:
        params[SEQUENCE_ID] = msg.correlation_id
        params[SEQUENCE_START] = bool(msg.flags & FLAG_START)
        params[SEQUENCE_END] = bool(msg.flags & FLAG_END)
    return params
