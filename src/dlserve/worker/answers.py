"""A model that is not decoupled answering through its requests' response senders
(Triton 24.06 and later): exactly one response per request, sent before or after
``execute`` returns, or returned by it; the final flag with it or after it.

Triton's rules and messages are the sender's (``pb_utils/request.py``). A response sent
before ``execute`` returns goes out with its return, as a returned one does (the inputs,
which may be a BLS caller's memory, stay the model's until then). A request still
unanswered then, whose sender the model keeps, gets a ``deferred`` notice instead (the
instance is free for the next requests) and its response once sent; a send the rules
refuse then, or the sender's being collected without a response, ends it with an error,
since nothing would answer it any more.
"""

from __future__ import annotations

import contextlib
import enum
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from dlserve import pb_utils as pb_utils
from dlserve.ipc import messages as m
from dlserve.ipc.channel import ChannelClosed
from dlserve.pb_utils.exceptions import TritonError, TritonModelException
from dlserve.pb_utils.request import SENT_TWICE
from dlserve.worker.bls import gpu_lending as gpu_bls
from dlserve.worker.failures import error_reply
from dlserve.worker.outputs import OutputWriter

if TYPE_CHECKING:
    from dlserve.worker.runner import Item

Route = Callable[[m.InferDone, list[memoryview]], None]  # where a late answer goes

_NOT_ANSWERED: Final = (
    "Python model '{}' sent no response for a request: {}. A model that is not decoupled "
    "answers each request exactly once, by returning its response from execute or by "
    "sending it with request.get_response_sender()."
)


class Deferred(enum.Enum):
    """In place of a response at ``execute``'s return: the response comes later."""

    LATER = "later"


class Execute:
    """What the requests of one ``execute`` share: their items, when it started, where
    late responses go, and whether it has returned (a sender opened after that is spent:
    the request was answered). It holds no request (no cycle: requests are freed as soon
    as the model lets them go)."""

    __slots__ = ("answers", "infer_start", "items", "returned", "route", "start")

    def __init__(self, answers: Answers, items: Sequence[Item], start: int, route: Route) -> None:
        self.answers = answers
        self.items = items
        self.start = start
        self.infer_start = start
        self.route = route
        self.returned = False

    def open_sender(self, request: pb_utils.InferenceRequest) -> pb_utils.InferenceResponseSender:
        """``request.get_response_sender()`` of one of them (found by its rid: rare)."""
        rid = request._rid
        item = next(item for item in self.items if item.rid == rid)
        return self.answers.sender(item, self, request)


class Answer:
    """A request whose model took its response sender: where its one response goes."""

    __slots__ = (
        "__weakref__",
        "answers",
        "done",
        "execute",
        "item",
        "lock",
        "refusal",
        "response",
        "returned",
        "route",
        "sender",
    )

    def __init__(self, answers: Answers, item: Item, execute: Execute, route: Route) -> None:
        self.answers = answers
        self.item = item
        self.execute = execute
        self.route = route
        self.lock = threading.Lock()
        self.response: pb_utils.InferenceResponse | None = None  # sent before the return
        self.returned = False  # execute has returned: a response goes out when sent
        self.done = False  # answered (or its response held until the return)
        self.refusal: TritonModelException | None = None  # a send refused before the return
        self.sender: weakref.ref[pb_utils.InferenceResponseSender] | None = None

    def emit(self, response: pb_utils.InferenceResponse | None, flags: int) -> None:
        """The sender's send, once its rules allowed it (any thread)."""
        del flags  # the rules have counted it; a final flag after the response sends nothing
        if response is None:
            return
        with self.lock:
            if self.done:  # ended otherwise meanwhile (execute failed, or an error)
                return
            self.done = True
            if not self.returned:
                self.response = response
                return
        self.answers.deliver(self, response, time.monotonic_ns())

    def refused(self, error: TritonModelException) -> None:
        """A send the rules refused: after the return, nothing else would answer it; before
        it, the request ends with it at the return unless a response was sent."""
        with self.lock:
            if not self.returned:  # a copy: the raised one's traceback holds the model's frames
                self.refusal = TritonModelException(error.message())
                return
        self._end(error)

    def abandoned(self) -> None:
        """The sender was collected (the janitor's thread)."""
        why = "its response sender was released without sending one"
        self._end(TritonError(self.answers.not_answered(why)))

    def _end(self, error: Exception) -> None:
        with self.lock:
            if not self.returned or self.done:
                return
            self.done = True
        sender = self.sender() if self.sender is not None else None
        if sender is not None:
            sender._close()
        self.answers.fail(self, error)

    def at_return(self) -> pb_utils.InferenceResponse | Deferred | TritonModelException | None:
        """``execute`` returned None in this request's place: the response sent before,
        the refusal of a send before it (and nothing sent), LATER when the model may still
        send it, None when nothing will answer it."""
        with self.lock:
            self.returned = self.execute.returned = True
            if self.done:
                return self.response
            sender = self.sender() if self.sender is not None else None
            if self.refusal is None and sender is not None and not sender.closed:
                return Deferred.LATER
            self.done = True
        if sender is not None:
            sender._close()
        return self.refusal


class Answers:
    """The default-mode answers of one model instance."""

    def __init__(
        self, outputs: OutputWriter, executing: dict[int, pb_utils.InferenceRequest],
        instance_name: Callable[[], str],
    ) -> None:  # fmt: skip
        """``outputs``: where a late response's outputs go; ``executing``: the instance's
        requests executing (an answered one leaves it); ``instance_name``: how Triton's
        messages name the instance."""
        self.outputs = outputs
        self.executing = executing
        self.instance_name = instance_name
        self._open: dict[int, Answer] = {}  # by rid: senders taken, not answered
        self._lock = threading.Lock()
        self._collected: queue.SimpleQueue[Answer | None] | None = None
        self._janitor: threading.Thread | None = None

    # -- during execute ---------------------------------------------------------------------
    def prepare(
        self, requests: Sequence[pb_utils.InferenceRequest], items: Sequence[Item],
        start: int, route: Route,
    ) -> Execute:  # fmt: skip
        """Let ``requests`` (of one execute) make their senders on demand (one bound method
        for them all: this runs for every request of every model)."""
        execute = Execute(self, items, start, route)
        opener = execute.open_sender
        for request, item in zip(requests, items, strict=True):
            request._open_sender, request._rid = opener, item.rid
        return execute

    def sender(
        self, item: Item, execute: Execute, request: pb_utils.InferenceRequest
    ) -> pb_utils.InferenceResponseSender:
        """The request's sender. The request does not hold it (the model does), so that a
        model that drops it unanswered is found out when it is collected."""
        with self._lock:
            answer = self._open.get(item.rid)
            sender = answer.sender() if answer is not None and answer.sender else None
            if sender is not None:
                return sender
            if answer is not None or execute.returned:  # answered (returned, or failed)
                spent = pb_utils.InferenceResponseSender(request, _nowhere, decoupled=False)
                spent._count_returned()
                return spent
            answer = Answer(self, item, execute, execute.route)
            sender = pb_utils.InferenceResponseSender(
                request, answer.emit, decoupled=False, on_refused=answer.refused
            )
            answer.sender = weakref.ref(sender)
            self._open[item.rid] = answer
        weakref.finalize(sender, self._queue().put, answer)
        return sender

    def count_returned(self, rid: int) -> None:
        """``execute`` returned a response for request ``rid``: with one sent as well,
        Triton's message (the whole execute fails, as in Triton)."""
        answer = self.take(rid)
        if answer is None:
            return
        sender = answer.sender() if answer.sender is not None else None
        if sender is not None:
            sender._count_returned()
        elif answer.done:
            raise TritonModelException(SENT_TWICE)

    def finish(self, rids: Sequence[int]) -> None:
        """These requests have their answers (returned, or failed): their senders send no
        more."""
        for rid in rids:
            answer = self._forget(rid)
            if answer is not None:
                with answer.lock:
                    answer.returned = answer.done = True

    def taken(self) -> bool:
        """Whether any request's sender is out (not answered yet)."""
        return bool(self._open)

    def take(self, rid: int) -> Answer | None:
        """The request's answer, if the model took its sender."""
        if not self._open:  # the usual: no model took one
            return None
        with self._lock:
            return self._open.get(rid)

    def close(self, rid: int) -> pb_utils.InferenceResponse | None:
        """``execute`` failed: the request's response if one was sent before (it stands),
        else None (the failure answers it); its sender sends no more."""
        answer = self._forget(rid)
        if answer is None:
            return None
        with answer.lock:
            answer.returned = answer.execute.returned = True
            response, answer.done = answer.response, True
        sender = answer.sender() if answer.sender is not None else None
        if sender is not None:
            sender._close()
        return response

    def returned(self, rid: int) -> pb_utils.InferenceResponse | Deferred:
        """``execute`` returned None in place of request ``rid``'s response: the response
        its sender sent, or LATER; raises when nothing will answer it."""
        answer = self.take(rid)
        outcome = answer.at_return() if answer is not None else None
        if outcome is not Deferred.LATER:
            self._forget(rid)
        if outcome is None:
            raise TritonError(self.not_answered("execute returned None in its place and its "
                                                "response sender sent nothing"))  # fmt: skip
        if isinstance(outcome, TritonModelException):
            raise outcome
        return outcome

    def _forget(self, rid: int) -> Answer | None:
        if not self._open:
            return None
        with self._lock:
            return self._open.pop(rid, None)

    def not_answered(self, why: str) -> str:
        return _NOT_ANSWERED.format(self.instance_name(), why)

    # -- after execute returned ---------------------------------------------------------------
    def deliver(self, answer: Answer, response: pb_utils.InferenceResponse, sent: int) -> None:
        """A response sent after ``execute`` returned: encoded and sent at once."""
        item = answer.item
        try:
            error = response.error()
            if error is not None:
                raise error
            settled = gpu_bls.settle_borrowed([item], every=True)
            done, buffers = self.outputs.reply(item, response, settled)
            execute = answer.execute
            done.timings = m.Timings(execute.start, execute.infer_start, sent, time.monotonic_ns())
        except BaseException as exc:
            done, buffers = error_reply(item.rid, exc), []
        self._send(answer, done, buffers)

    def fail(self, answer: Answer, error: BaseException) -> None:
        with contextlib.suppress(TritonModelException):  # the error goes either way
            gpu_bls.settle_borrowed([answer.item], every=True)
        self._send(answer, error_reply(answer.item.rid, error), [])

    def _send(self, answer: Answer, done: m.InferDone, buffers: list[memoryview]) -> None:
        self._forget(answer.item.rid)
        self.executing.pop(answer.item.rid, None)
        with contextlib.suppress(ChannelClosed):  # the server is gone: nobody waits for it
            answer.route(done, buffers)

    # -- senders collected --------------------------------------------------------------------
    def _queue(self) -> queue.SimpleQueue[Answer | None]:
        """Where collected senders' answers go: a finalizer may run in any thread, holding
        any lock (a send's), so it only queues (SimpleQueue.put is safe there) and a thread
        of ours ends the request."""
        with self._lock:
            if self._collected is None:
                self._collected = queue.SimpleQueue()
                self._janitor = threading.Thread(
                    target=self._sweep, args=(self._collected,), name="dlserve-senders",
                    daemon=True,
                )  # fmt: skip
                self._janitor.start()
            return self._collected

    @staticmethod
    def _sweep(collected: queue.SimpleQueue[Answer | None]) -> None:
        while (answer := collected.get()) is not None:
            answer.abandoned()

    def stop(self) -> None:
        if self._collected is not None:
            self._collected.put(None)


def _nowhere(response: Any, flags: int) -> None:
    """A spent sender's emit: never called (its rules refuse every send)."""
