"""Calls from model code (BLS): run as ordinary requests of the callee, answered in frames.

A worker's BlsCall becomes an :class:`InferRequest` that goes through the same path as a
client's (version lookup, validation, instance choice, statistics); its responses go
back to the caller as BlsReply frames. A call into a model that is already upstream of
it (A -> B -> A, or A -> A) is refused: its instance may be the one waiting, and the
call would wait for itself. A call's ``timeout`` (microseconds, as Triton's) bounds the
wait; past it the caller gets Triton's "Request timeout expired" and the callee's
request is marked cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Coroutine
from typing import TYPE_CHECKING, Any

from dlserve import errors
from dlserve.ipc import messages as m
from dlserve.types import InferRequest, InferResponse, InputTensor, RegionRef, RequestedOutput
from dlserve.workers.client import WorkerBase

if TYPE_CHECKING:
    from dlserve.core.service import InferenceService, StreamItem

log = logging.getLogger("dlserve.bls")

_NOT_DECOUPLED_CALL = (
    "Model {name} is using the decoupled. The current BLS request call doesn't support models "
    "using the decoupled transaction policy. Please use 'decoupled=True' argument to the "
    "'exec' or 'async_exec' calls for decoupled models."
)


def cycle_error(chain: list[str], callee: str) -> errors.DlserveError | None:
    """The refusal of a call into a model already upstream of it, or None."""
    if callee not in chain:
        return None
    path = " -> ".join([*chain, callee])
    return errors.UnavailableError(
        f"circular BLS call {path}: model '{callee}' is already waiting on this call chain, "
        "so the call could wait for itself; dlserve refuses it instead of deadlocking"
    )


class BlsRouter:
    """The core's side of workers' calls (``workers.client.CallSink``)."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service
        self._tasks: set[asyncio.Task[None]] = set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- BLS ------------------------------------------------------------------------------
    def on_bls(self, caller: WorkerBase, msg: m.BlsCall, payload: memoryview) -> None:
        self._spawn(self._serve(caller, msg, payload))

    async def _serve(self, caller: WorkerBase, msg: m.BlsCall, payload: memoryview) -> None:
        sent_final = False
        try:
            refused = cycle_error(msg.chain, msg.model_name)
            if refused is not None:
                raise refused
            request, call = self._request(msg, payload)
            timeout = msg.timeout_us / 1e6 if msg.timeout_us > 0 else None
            try:
                async with asyncio.timeout(timeout):
                    if msg.decoupled:
                        async for item in self._stream(request, call):
                            _answer(caller, msg.call, item.response, item.error, item.final)
                            sent_final = item.final
                        return
                    response = await self._single(request, call)
            except TimeoutError:
                raise errors.UnavailableError("Request timeout expired") from None
            _answer(caller, msg.call, response, None, True)
            sent_final = True
        except errors.DlserveError as exc:
            if not sent_final:
                _answer(caller, msg.call, None, exc, True)
        except Exception as exc:  # a bug: the caller must not wait forever
            log.exception("BLS call to model '%s' failed", msg.model_name)
            if not sent_final:
                _answer(caller, msg.call, None, errors.InternalError(str(exc)), True)

    async def _single(self, request: InferRequest, call: object) -> InferResponse:
        loaded = self.service.version(request.model_name, request.model_version)
        if loaded.decoupled:
            raise errors.UnsupportedError(_NOT_DECOUPLED_CALL.format(name=request.model_name))
        return await self.service.infer(request, call)  # type: ignore[arg-type]

    async def _stream(
        self, request: InferRequest, call: object
    ) -> AsyncGenerator[StreamItem, None]:
        items = self.service.infer_stream(request, call)  # type: ignore[arg-type]
        async with contextlib.aclosing(items):
            async for item in items:
                yield item

    def _request(self, msg: m.BlsCall, payload: memoryview) -> tuple[InferRequest, object]:
        from dlserve.core.service import Call

        inputs: list[InputTensor] = []
        spans: dict[str, tuple[int, str, int, int]] = {}
        for ref in msg.inputs:
            shape = tuple(ref.shape)
            if ref.where == m.Where.CLIENT_REGION:  # by reference: the callee maps it
                region = RegionRef("", ref.nbytes, ref.offset)
                inputs.append(InputTensor(ref.name, ref.datatype, shape, None, {}, region))
                spans[ref.name] = (ref.region, ref.key, ref.offset, ref.nbytes)
            else:
                data = payload[ref.offset : ref.offset + ref.nbytes]
                inputs.append(InputTensor(ref.name, ref.datatype, shape, data))
        lease = self.service.regions.lease_spans(spans) if spans else None
        version = "" if msg.model_version < 0 else str(msg.model_version)
        request = InferRequest(
            msg.model_name, version, msg.request_id, inputs,
            [RequestedOutput(name) for name in msg.outputs], dict(msg.parameters),
        )  # fmt: skip
        return request, Call(tuple(msg.chain), lease)

    # -- model control --------------------------------------------------------------------
    def on_control(self, caller: WorkerBase, msg: m.ControlCall) -> None:
        self._spawn(self._control(caller, msg))

    async def _control(self, caller: WorkerBase, msg: m.ControlCall) -> None:
        reply = m.ControlReply(call=msg.call)
        try:
            if msg.op == "ready":
                reply.ready = self.service.model_ready(msg.model_name, msg.model_version)
            elif msg.op == "load":
                await self.service.load_model(msg.model_name, msg.config or None)
            elif msg.op == "unload":
                await self.service.unload_model(msg.model_name)
            else:
                raise errors.InvalidArgumentError(f"unknown model control call '{msg.op}'")
        except errors.DlserveError as exc:
            reply.error, reply.error_code = exc.message, exc.code.value
        caller.send_answer(reply, [])


def _answer(
    caller: WorkerBase,
    call: int,
    response: InferResponse | None,
    error: errors.DlserveError | None,
    final: bool,
) -> None:
    """One BlsReply: the response's outputs inline in the frame (they become the caller's
    arrays), or the error."""
    if error is not None:
        caller.send_answer(
            m.BlsReply(call, error=error.message, error_code=error.code.value, final=final), []
        )
        return
    if response is None:
        caller.send_answer(m.BlsReply(call, final=final, has_response=False), [])
        return
    refs: list[m.TensorRef] = []
    payload: list[memoryview] = []
    offset = 0
    for output in response.outputs:
        data = memoryview(output.data if output.data is not None else b"")
        refs.append(
            m.TensorRef(
                output.name,
                output.datatype,
                list(output.shape),
                m.Where.PAYLOAD,
                offset,
                data.nbytes,
            )
        )
        payload.append(data)
        offset += data.nbytes
    reply = m.BlsReply(call, refs, final=final, parameters=dict(response.parameters))
    caller.send_answer(reply, payload)
