"""A worker's frame the server cannot read: the one request or call it belongs to fails,
the connection and the instance go on.

pb_utils checks what a model hands over before it is encoded, so such a frame means a
bug (or a model writing to the worker's socket). Its kind and its request or call id are
read leniently (``codec.UnreadableFrame``); the request it answers fails with an error
that names the model, a call it makes gets an error answer, the output memory it names
goes back to the worker, and the cause is logged. A frame whose kind or id cannot be
read is logged and dropped: nothing can be failed for it without failing innocents.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dlserve.ipc import codec
from dlserve.ipc import messages as m

if TYPE_CHECKING:
    from dlserve.server.core.instances.handle import WorkerHandle

log = logging.getLogger("dlserve.workers")
_INTERNAL = "internal"


def describe(worker: WorkerHandle, bad: codec.UnreadableFrame) -> str:
    """The error's text: the model, its instance, what kind of frame, and why."""
    return f"model '{worker.model_name}' (instance '{worker.label}') sent {bad.what}: {bad.cause}"


def stand_in(
    worker: WorkerHandle, bad: codec.UnreadableFrame, discard: Callable[[list[m.TensorRef]], None]
) -> m.WorkerToServer | None:
    """Log why ``bad`` cannot be read, give back the output memory it names (``discard``)
    and answer a call it makes with an error; the frame that stands in for it (the
    request it answers, failed), or None."""
    error = describe(worker, bad)
    ident = bad.ident
    log.error("%s", error if ident is None else f"{error} (id {ident})")
    if ident is None:
        return None
    fields = bad.fields
    if bad.kind is m.InferDone:
        discard(fields.get("outputs", []))
        return m.InferDone(ident, error=error, error_code=_INTERNAL)
    if bad.kind is m.StreamResponse:
        discard(fields.get("outputs", []))
        return _stream_response(ident, fields, error)
    answer = _answer(bad.kind, ident, error)
    if answer is not None:
        worker.send_answer(answer, [])
    return None


def _stream_response(rid: int, fields: dict[str, Any], error: str) -> m.StreamResponse:
    """A decoupled request's response fails (its flags kept: a final one still ends the
    request); an executed notice is one still, without its timings."""
    if fields.get("executed") is True:
        return m.StreamResponse(rid, has_response=False, executed=True,
                                rescheduled=fields.get("rescheduled") is True)  # fmt: skip
    final = fields.get("final") is True
    return m.StreamResponse(rid, error=error, error_code=_INTERNAL, final=final)


def _answer(kind: type[m._Msg] | None, call: int, error: str) -> Answer | None:
    """The error answer to a call the worker made (None: one that wants no answer)."""
    if kind is m.BlsCall:
        return m.BlsReply(call, error=error, error_code=_INTERNAL)
    if kind is m.ControlCall:
        return m.ControlReply(call, error=error, error_code=_INTERNAL)
    if kind is m.MetricValueCall:
        return m.MetricValueReply(call, 0.0, error=error)
    if kind is m.DirectOpen:  # not directly, this time: the call goes through the server
        return m.DirectTargets(call, error=error)
    return None  # BlsCredit: a caller's note, nothing waits for an answer


Answer = m.BlsReply | m.ControlReply | m.MetricValueReply | m.DirectTargets
