"""Decoupled models: ``execute`` returns None and responses leave through the sender.

Each response is a StreamResponse frame, sent from whichever thread of the model calls
``send()``; the one with the final flag ends the request and carries its timings. When
``execute`` returns, an ``executed`` notice tells the server's scheduler that the instance
can take the next request. An ``async def execute`` is started on the instance's event
loop and the notice goes at once (Triton's stub does the same): its requests overlap with
the next ones, and a failure it meets later reaches its requests and the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import sys
import time
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from dlserve import pb_utils as pb_utils
from dlserve.ipc import messages as m
from dlserve.pb_utils import logger
from dlserve.pb_utils.exceptions import TritonError, TritonModelException
from dlserve.worker.bls import gpu_lending as gpu_bls
from dlserve.worker.cancellation import Cancellation, upstream
from dlserve.worker.event_loop import ModelLoop
from dlserve.worker.failures import describe_error, execute_failure
from dlserve.worker.link import link
from dlserve.worker.outputs import OutputWriter

if TYPE_CHECKING:
    from dlserve.worker.runner import Item


class Instance(Protocol):
    """What a decoupled ``execute`` uses of its model instance (the worker's runner)."""

    load: m.Load
    model: Any
    model_loop: ModelLoop
    outputs: OutputWriter
    cancellation: Cancellation

    def request(self, item: Item, payload: memoryview) -> pb_utils.InferenceRequest:
        """The InferenceRequest the model gets for ``item``; raises if it cannot be made."""


def decoupled_execute(
    instance: Instance,
    worker: link.WorkerLink,
    items: Sequence[Item],
    payload: memoryview,
    start: int,
) -> None:
    """One ``execute`` of a decoupled model for ``items`` (the requests the scheduler
    gathered, one or several): it returns None and each request's responses go out through
    its sender, as StreamResponse frames, from any thread of the model. A request that
    fails before the model sees it, or whose final flag has not been sent when ``execute``
    raises, gets an error response with the final flag. Each request's ``executed`` notice
    follows once ``execute`` has returned."""
    infer_start = infer_end = 0
    streams: list[_Stream] = []
    outputs, executing = instance.outputs, instance.cancellation.executing
    try:
        requests: list[pb_utils.InferenceRequest] = []
        for item in items:
            stream = _Stream(worker, item, start, outputs, executing)
            try:
                request = instance.request(item, payload)
            except BaseException as exc:  # this request alone fails
                stream.fail(exc)
                continue
            stream.sender = pb_utils.InferenceResponseSender(request, stream.emit)
            stream.request = request
            request._sender = stream.sender
            worker.flow.open_window(item.rid)
            request._poll = worker.poll
            executing[item.rid] = request
            streams.append(stream)
            requests.append(request)
        if requests:
            infer_start, infer_end = _execute(instance, streams, requests)
    finally:  # the instance is free for the next requests; responses may go on
        now = time.monotonic_ns()
        timings = m.Timings(start, infer_start or now, infer_end or now, now)
        again = {s.msg.rid for s in streams if s.rescheduled()}
        for item in items:
            notice = m.StreamResponse(rid=item.rid, has_response=False, executed=True,
                                      timings=timings, rescheduled=item.rid in again)  # fmt: skip
            worker.send(notice)


def _execute(
    instance: Instance, streams: list[_Stream], requests: list[pb_utils.InferenceRequest]
) -> tuple[int, int]:
    """Call execute once for ``requests``: when it started and when it returned. An
    ``async def execute`` is started on the instance's event loop and left to run there
    (as Triton does): the instance takes its next request while this one awaits."""
    infer_start = time.monotonic_ns()
    for stream in streams:
        stream.infer_start = infer_start
    try:
        result = instance.model.execute(requests)
        if asyncio.iscoroutine(result):
            context = link.upstream_context(upstream([s.msg for s in streams]))
            done = functools.partial(_coroutine_done, instance.load, streams)
            instance.model_loop.start(result, context, done)
            return infer_start, time.monotonic_ns()
        if result is not None and inspect.isawaitable(result):
            result = instance.model_loop.run(result)
        if result is not None:
            raise TritonError(returned_responses(instance.load))
    except BaseException as exc:  # every request whose final flag is not out fails
        _fail_open(streams, execute_failure(instance.load.instance_name, exc))
        return infer_start, streams[0].infer_end
    infer_end = time.monotonic_ns()
    for stream in streams:
        stream.infer_end = infer_end
    return infer_start, infer_end


def returned_responses(load: m.Load) -> str:
    """Triton's message for a decoupled model whose execute returned something."""
    return (
        f"Python model '{load.instance_name or load.model_name}' is using the "
        "decoupled mode and the execute function must return None."
    )


def _coroutine_done(load: m.Load, streams: list[_Stream], task: asyncio.Task[Any]) -> None:
    """An ``async def execute`` started in the background has ended (on the loop's thread):
    if it failed (or returned something), the error goes to the log, with its traceback as
    Triton logs it, and to each of its requests whose final flag is not out."""
    if task.cancelled():  # the instance is stopping
        exc: BaseException = TritonError("execute was cancelled: the model instance stopped")
    else:
        error = task.exception()
        if error is None and task.result() is None:
            now = time.monotonic_ns()
            for stream in streams:
                stream.infer_end = now
            return
        exc = error if error is not None else TritonError(returned_responses(load))
        log_failure(load, exc)
    _fail_open(streams, execute_failure(load.instance_name, exc))


def _fail_open(streams: list[_Stream], exc: BaseException) -> None:
    infer_end = time.monotonic_ns()
    for stream in streams:
        stream.infer_end = infer_end
        sender = stream.sender
        if sender is not None and sender._close():
            stream.fail(exc)


def log_failure(load: m.Load, exc: BaseException) -> None:
    """An error line in the server's log (the worker's stderr) for a failure that happened
    in the background, with the exception's traceback (``load``: the instance's)."""
    if exc.__traceback__ is None:  # not raised: dlserve's own check
        text = describe_error(exc)[0]
    else:
        text = "".join(traceback.format_exception(exc)).rstrip("\n")
    frames = traceback.extract_tb(exc.__traceback__)
    filename = os.path.basename(frames[-1].filename) if frames else "model.py"
    lineno = (frames[-1].lineno or 0) if frames else 0
    line = logger.format_line(
        f"Failed to process the request(s) for model '{load.instance_name}', message: "
        f"{text}", logger.LogLevel.ERROR, filename, lineno, load.model_name,
    )  # fmt: skip
    with contextlib.suppress(OSError, ValueError):  # a closed stderr loses the line only
        sys.stderr.write(line)
        sys.stderr.flush()


class _Stream:
    """The responses of one decoupled request on their way to the server."""

    def __init__(
        self, worker: link.WorkerLink, msg: Item, start: int, outputs: OutputWriter,
        executing: dict[int, pb_utils.InferenceRequest],
    ) -> None:  # fmt: skip
        self.outputs = outputs
        self.executing = executing  # the instance's; the final flag takes the request out
        self.worker = worker
        self.msg = msg
        self.start = start
        self.infer_start = start
        self.infer_end = 0
        self.sender: pb_utils.InferenceResponseSender | None = None
        self.request: pb_utils.InferenceRequest | None = None

    def _cancelled(self) -> bool:
        return self.request is not None and self.request._cancelled

    def rescheduled(self) -> bool:
        """The model asked to run the request again, and has not ended it (final flag)."""
        request, sender = self.request, self.sender
        return (
            request is not None and sender is not None and not sender.closed
            and request._release_flags == pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE
        )  # fmt: skip

    def emit(self, response: pb_utils.InferenceResponse | None, flags: int) -> None:
        """Send one response (from any thread of the model). A response that is not final
        waits while the request's consumer has not taken enough of the earlier ones (flow
        control); once the request is cancelled it is dropped, as Triton drops responses
        nobody reads. The final flag always goes, at once."""
        final = flags == pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if not final and not self.worker.flow.hold_send(self.msg.rid, self._cancelled):
            return
        if final:  # the request's borrowed GPU inputs go back to their owner with it
            try:
                gpu_bls.settle_borrowed([self.msg])
            except TritonModelException as exc:
                self.fail(exc)
                return
        frame = m.StreamResponse(rid=self.msg.rid, final=final, has_response=response is not None)
        buffers: list[memoryview] = []
        if response is not None:
            error = response.error()
            if error is not None:
                frame.error, frame.error_code = error.message(), error.error_code().value
            else:
                try:
                    frame.outputs, buffers, frame.parameters = self.outputs.encode(
                        self.msg, response
                    )
                except BaseException as exc:
                    frame.error, frame.error_code = describe_error(exc)
        if not final:
            self.worker.flow.sent_bytes(self.msg.rid, m.stream_bytes(frame.outputs))
        self._send(frame, buffers)

    def fail(self, exc: BaseException) -> None:
        with contextlib.suppress(TritonModelException):  # the error goes either way
            gpu_bls.settle_borrowed([self.msg])
        frame = m.StreamResponse(rid=self.msg.rid, final=True)
        frame.error, frame.error_code = describe_error(exc)
        self._send(frame, [])

    def _send(self, frame: m.StreamResponse, buffers: list[memoryview]) -> None:
        if frame.final:
            now = time.monotonic_ns()
            self.executing.pop(self.msg.rid, None)
            frame.timings = m.Timings(self.start, self.infer_start, self.infer_end or now, now)
            self.worker.flow.close_window(self.msg.rid)
        self.worker.send(frame, buffers)
