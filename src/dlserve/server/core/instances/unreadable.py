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
from typing import TYPE_CHECKING, Any

from dlserve.ipc import codec
from dlserve.ipc import messages as m

if TYPE_CHECKING:
    from dlserve.server.core.instances.handle import WorkerBase

log = logging.getLogger("dlserve.workers")
_INTERNAL = "internal"


def describe(worker: WorkerBase, bad: codec.UnreadableFrame) -> str:
    """The error's text: the model, its instance, what kind of frame, and why."""
    return f"model '{worker.model_name}' (instance '{worker.label}') sent {bad.what}: {bad.cause}"


def handle(worker: WorkerBase, bad: codec.UnreadableFrame) -> None:
    """Fail what ``bad`` belongs to, give back the memory it names, log why."""
    error = describe(worker, bad)
    ident = bad.ident
    log.error("%s", error if ident is None else f"{error} (id {ident})")
    if ident is None:
        return
    fields = bad.fields
    if bad.kind is m.InferDone:
        worker.discard((m.InferDone(ident, fields.get("outputs", [])), bad.payload))
        worker._on_frame(m.InferDone(ident, error=error, error_code=_INTERNAL), bad.payload)
    elif bad.kind is m.StreamResponse:
        _stream_response(worker, ident, fields, error, bad.payload)
    else:
        answer = _answer(bad.kind, ident, error)
        if answer is not None:
            worker.send_answer(answer, [])


def _stream_response(
    worker: WorkerBase, rid: int, fields: dict[str, Any], error: str, payload: memoryview
) -> None:
    """A decoupled request's response fails (its flags kept: a final one still ends the
    request); an executed notice is one still, without its timings."""
    worker.discard((m.InferDone(rid, fields.get("outputs", [])), payload))
    if fields.get("executed") is True:
        notice = m.StreamResponse(rid, has_response=False, executed=True,
                                  rescheduled=fields.get("rescheduled") is True)  # fmt: skip
        worker._on_frame(notice, payload)
        return
    final = fields.get("final") is True
    response = m.StreamResponse(rid, error=error, error_code=_INTERNAL, final=final)
    worker._on_frame(response, payload)


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
