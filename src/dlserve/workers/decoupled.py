"""Decoupled models: ``execute`` returns None and responses leave through the sender.

Each response is a StreamResponse frame, sent from whichever thread of the model calls
``send()``; the one with the final flag ends the request and carries its timings. When
``execute`` returns, an ``executed`` notice tells the server's scheduler that the instance
can take the next request.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from dlserve import backend as pb_utils
from dlserve.backend import link
from dlserve.backend.errors import TritonModelException
from dlserve.ipc import messages as m

if TYPE_CHECKING:
    from dlserve.workers.runner import Item, ModelRunner


def decoupled_request(
    runner: ModelRunner, worker: link.WorkerLink, msg: Item, payload: memoryview, start: int
) -> None:
    """Run one request of a decoupled model: execute returns None and the responses go out
    through the request's sender, as StreamResponse frames, from any thread of the model.
    A failure before the final flag is sent as an error response with the final flag."""
    try:
        _execute(runner, worker, msg, payload, start)
    finally:  # the instance is free for the next request; responses may go on
        worker.send(m.StreamResponse(rid=msg.rid, has_response=False, executed=True))


def _execute(
    runner: ModelRunner, worker: link.WorkerLink, msg: Item, payload: memoryview, start: int
) -> None:
    stream = _Stream(runner, worker, msg, start)
    try:
        request = runner._request(msg, payload)
    except BaseException as exc:
        stream.fail(exc)
        return
    sender = pb_utils.InferenceResponseSender(request, stream.emit)
    request._sender = sender
    request._poll = worker.poll
    runner._live[msg.rid] = request
    stream.infer_start = time.monotonic_ns()
    try:
        result = runner._call(runner.model.execute, [request])
        if result is not None:
            raise TritonModelException(
                f"Python model '{runner.load.model_name}' is using the decoupled mode and the "
                "execute function must return None."
            )
    except BaseException as exc:
        stream.infer_end = time.monotonic_ns()
        if not sender.closed:
            sender._closed = True
            stream.fail(exc)
        return
    stream.infer_end = time.monotonic_ns()


class _Stream:
    """The responses of one decoupled request on their way to the server."""

    def __init__(self, runner: ModelRunner, worker: link.WorkerLink, msg: Item, start: int) -> None:
        self.runner = runner
        self.worker = worker
        self.msg = msg
        self.start = start
        self.infer_start = start
        self.infer_end = 0

    def emit(self, response: pb_utils.InferenceResponse | None, flags: int) -> None:
        final = flags == pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        frame = m.StreamResponse(rid=self.msg.rid, final=final, has_response=response is not None)
        buffers: list[memoryview] = []
        if response is not None:
            error = response.error()
            if error is not None:
                frame.error, frame.error_code = error.message(), error.error_code().value
            else:
                try:
                    frame.outputs, buffers, frame.parameters = self.runner.encode_outputs(
                        self.msg, response
                    )
                except BaseException as exc:
                    frame.error, frame.error_code = self.runner.describe_error(exc)
        self._send(frame, buffers)

    def fail(self, exc: BaseException) -> None:
        frame = m.StreamResponse(rid=self.msg.rid, final=True)
        frame.error, frame.error_code = self.runner.describe_error(exc)
        self._send(frame, [])

    def _send(self, frame: m.StreamResponse, buffers: list[memoryview]) -> None:
        if frame.final:
            now = time.monotonic_ns()
            self.runner._live.pop(self.msg.rid, None)
            frame.timings = m.Timings(self.start, self.infer_start, self.infer_end or now, now)
        self.worker.send(frame, buffers)
