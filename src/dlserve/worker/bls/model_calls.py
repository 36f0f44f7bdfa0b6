"""Business Logic Scripting: a model's requests to other models, and model control.

A call to a plain model goes straight to one of its instances where it can
(``direct_caller.py``). Otherwise ``InferenceRequest.exec()`` sends one typed BlsCall
frame to the server, which runs it as an ordinary request of the callee (validation,
instance choice, statistics) and answers with BlsReply frames. Either way the tensors
travel by reference where the callee can map them (``tensors.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from dlserve.ipc import messages as m
from dlserve.ipc.channel import ChannelClosed
from dlserve.pb_utils.exceptions import TritonModelException
from dlserve.pb_utils.request import InferenceRequest, InferenceResponse, InferenceTrace
from dlserve.pb_utils.runtime import outside_execute
from dlserve.pb_utils.tensor import Tensor
from dlserve.worker.bls.direct_caller import Started, start_direct
from dlserve.worker.bls.tensors import encode_inputs, response
from dlserve.worker.link import link

_FORKED = (
    "{what} cannot be used in a process the model forked (multiprocessing's 'fork' start "
    "method): that process shares its instance's connection to the server. Make the call "
    "in the model's own process (from a thread, or with async_exec)"
)
_OUTSIDE_EXECUTE = "BLS is only supported during the 'execute' function."  # Triton's


def _worker(what: str) -> link.WorkerLink:
    worker = link.current()
    if worker is None:
        if link.forked():
            raise TritonModelException(_FORKED.format(what=what))
        raise outside_execute(what)
    return worker


def _serving(what: str) -> link.WorkerLink:
    """The calling thread's link. BLS calls are made once ``initialize`` has returned and
    until ``finalize`` starts (from ``execute`` or from threads the model started), as in
    Triton."""
    worker = _worker(what)
    if not worker.serving:
        raise TritonModelException(_OUTSIDE_EXECUTE)
    return worker


# -- requests ------------------------------------------------------------------------------


def _call_message(request: InferenceRequest, call: int, decoupled: bool) -> m.BlsCall:
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


def _send(worker: link.WorkerLink, request: InferenceRequest, decoupled: bool) -> int:
    if not request.model_name():
        raise TritonModelException("BLS request needs a model_name")
    refs, payload = encode_inputs(request.inputs(), worker.memory)
    call = worker.next_call_id()
    msg = _call_message(request, call, decoupled)
    msg.inputs = refs
    msg.chain = [*worker.upstream, worker.instance]  # this instance waits for the callee
    worker.open_call(call)
    try:
        worker.send(msg, payload)
    except ChannelClosed:
        worker.close_call(call)
        raise TritonModelException("the connection to the server is closed") from None
    except BaseException:  # the frame could not be sent (frames.sendable says why)
        worker.close_call(call)
        raise
    return call


def _next_reply(worker: link.WorkerLink, call: int) -> tuple[m.BlsReply, memoryview]:
    """The next answer to ``call``. The server always answers (an error at worst)."""
    try:
        answer = worker.wait_answer(call, None)
    except ChannelClosed:
        raise TritonModelException("the connection to the server is closed") from None
    assert answer is not None and isinstance(answer[0], m.BlsReply)
    return answer[0], answer[1]


class ResponseIterator:
    """The responses of a BLS call to a decoupled model, the empty final one included.

    As Triton's: it keeps every response it has given, so that once the last has come a new
    iteration (``for`` again, after the previous one ran to its end) starts over from the first; an
    iteration left early resumes where it stopped. The server forwards the responses as they come
    (not held back by what this iterator has taken: server/core/calls/bls_router.py says why);
    cancelling it, or its being collected unfinished, ends the callee's
    request."""

    def __init__(
        self, worker: link.WorkerLink, call: int, inputs: list[Tensor],
        first: tuple[m.BlsReply, memoryview] | None = None,
    ) -> None:  # fmt: skip
        self._worker = worker
        self._call = call
        self._done = False  # no more responses will come (the final one, or cancelled)
        self._responses: list[InferenceResponse] = []
        self._next = 0  # once done: the index of the next response to give again
        self._inputs = inputs  # the callee may read the caller's memory until the end
        self._first = first  # the first answer, read already (async_exec)

    def __iter__(self) -> ResponseIterator:
        if self._done and self._next >= len(self._responses):
            self._next = 0  # the previous iteration ran to its end: start over
        return self

    def __next__(self) -> InferenceResponse:
        if self._done:
            if self._next >= len(self._responses):
                raise StopIteration
            self._next += 1
            return self._responses[self._next - 1]
        if self._first is not None:
            (reply, payload), self._first = self._first, None
        else:
            reply, payload = _next_reply(self._worker, self._call)
        answer = response(self._worker, reply, payload)
        self._responses.append(answer)
        if reply.final:
            self._finish()
        return answer

    def _finish(self) -> None:
        self._done = True
        self._next = len(self._responses)  # this iteration has given them all
        self._inputs = []
        self._worker.close_call(self._call)

    def _credit(self, msg: m.BlsCredit) -> None:
        with contextlib.suppress(ChannelClosed):  # the server is gone: nothing to tell
            self._worker.send(msg)

    def cancel(self) -> None:
        """Stop listening: responses still coming are dropped, and the callee's request
        is cancelled (it sees ``is_cancelled()``)."""
        if not self._done:
            self._finish()
            self._credit(m.BlsCredit(self._call, stop=True))

    def __del__(self) -> None:
        if not self._done:
            self._worker.close_call(self._call)
            self._worker.stop_call_later(self._call)


def execute(request: InferenceRequest, decoupled: bool) -> InferenceResponse | ResponseIterator:
    worker = _serving("InferenceRequest.exec()")
    if not decoupled:
        started = start_direct(worker, request)
        if started is not None:
            answer = started.finish() if isinstance(started, Started) else started
            if answer is not None:
                return answer
    call = _send(worker, request, decoupled)
    if decoupled:
        return ResponseIterator(worker, call, request.inputs())
    try:
        reply, payload = _next_reply(worker, call)
    finally:
        worker.close_call(call)
    return response(worker, reply, payload)


async def async_execute(
    request: InferenceRequest, decoupled: bool
) -> InferenceResponse | ResponseIterator:
    """As :func:`execute`; the wait runs in a thread so the model's loop goes on."""
    worker = _serving("InferenceRequest.async_exec()")
    if not decoupled:
        started = start_direct(worker, request)
        if started is not None:
            answer = (await asyncio.to_thread(started.finish)
                      if isinstance(started, Started) else started)  # fmt: skip
            if answer is not None:
                return answer
    call = _send(worker, request, decoupled)
    if decoupled:  # the first response is awaited here, as Triton's async_exec does: a
        # model that iterates then does not hold its event loop while the callee works
        try:
            first = await asyncio.to_thread(_next_reply, worker, call)
        except BaseException:
            worker.close_call(call)
            worker.stop_call_later(call)
            raise
        return ResponseIterator(worker, call, request.inputs(), first)
    try:
        reply, payload = await asyncio.to_thread(_next_reply, worker, call)
    finally:
        worker.close_call(call)
    return response(worker, reply, payload)


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
