"""What a worker does with a frame it cannot write or read, so that neither ends its link.

pb_utils checks what a model hands over, so a frame that cannot be encoded is rare: an
exception message that is not UTF-8 text, say, which is sent with replacement characters.
Past that, a reply (InferDone, StreamResponse) is sent as the error of its request, and
the output memory it named goes back; any other frame is the model's call failing, with
TritonModelException at the call.

A frame that cannot be read (``codec.UnreadableFrame``) fails what it belongs to: an
answer the model waits for becomes an error answer, a request (from the server or a
direct caller) is answered with an error; anything else is reported on stderr and
dropped. The frames around it are read as usual.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import msgspec

from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.pb_utils.exceptions import TritonModelException

Answer = m.MetricValueReply | m.BlsReply | m.ControlReply | m.DirectTargets
Release = Callable[[list[int], list[int]], None]  # output-arena offsets, GPU lend ids
_INTERNAL = "internal"


def sendable(failed: codec.UnencodableFrame, model: str, release: Release | None) -> m._Msg:
    """The frame to send instead of ``failed.message``: the same with its text made UTF-8
    (an exception's message, say), else its request's error (its outputs' memory
    released); raises TritonModelException for a frame the model's call sent."""
    message = failed.message
    cleaned = _clean_text(message)
    if cleaned is not None:
        return cleaned
    if not isinstance(message, m.InferDone | m.StreamResponse):
        raise TritonModelException(
            f"model '{model}' cannot send {type(message).__name__}: {failed.cause}"
        )
    if release is not None:
        offsets, gpu = arena_outputs(message.outputs)
        if offsets or gpu:
            release(offsets, gpu)
    error = f"the response of model '{model}' cannot be sent: {failed.cause}"
    if isinstance(message, m.InferDone):
        return m.InferDone(message.rid, error=error, error_code=_INTERNAL,
                           timings=message.timings, direct=message.direct,
                           fences=message.fences)  # fmt: skip
    if message.executed:  # a notice, no response: its timings are numbers of ours
        return m.StreamResponse(message.rid, has_response=False, timings=message.timings,
                                executed=True, rescheduled=message.rescheduled)  # fmt: skip
    return m.StreamResponse(message.rid, error=error, error_code=_INTERNAL,
                            final=message.final, timings=message.timings)  # fmt: skip


def _clean_text(message: m._Msg) -> m._Msg | None:
    """``message`` with its text fields that have no UTF-8 form (lone surrogates) written
    with replacement characters; None when none needed it."""
    changes = {}
    for field in msgspec.structs.fields(message):
        value = getattr(message, field.name)
        if isinstance(value, str) and not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                changes[field.name] = value.encode(errors="replace").decode()
    return msgspec.structs.replace(message, **changes) if changes else None


def replace(
    frames: Sequence[tuple[m._Msg, Sequence[bytes | memoryview]]], failed: codec.UnencodableFrame,
    substitute: m._Msg,
) -> list[tuple[m._Msg, Sequence[bytes | memoryview]]]:  # fmt: skip
    """``frames`` with the one that failed replaced (its payload kept: unread by an error
    reply, which names none of it)."""
    return [(substitute if msg is failed.message else msg, pay) for msg, pay in frames]


def arena_outputs(outputs: list[m.TensorRef]) -> tuple[list[int], list[int]]:
    """The output-arena offsets and lent GPU outputs (lend ids) that ``outputs`` hold."""
    offsets = [ref.offset for ref in outputs if ref.where == m.Where.OUTPUT_ARENA]
    gpu = [ref.lend for ref in outputs if ref.where == m.Where.CUDA_IPC and ref.lend]
    return offsets, gpu


def error_answer(bad: codec.UnreadableFrame, what: str) -> Answer | None:
    """The error answer that stands for an unreadable answer to a call (None: ``bad`` is
    not one, or its call cannot be told)."""
    call = bad.ident
    if call is None:
        return None
    error = f"{what} sent {bad.what}: {bad.cause}"
    if bad.kind is m.BlsReply:
        return m.BlsReply(call, error=error, error_code=_INTERNAL)
    if bad.kind is m.ControlReply:
        return m.ControlReply(call, error=error, error_code=_INTERNAL)
    if bad.kind is m.MetricValueReply:
        return m.MetricValueReply(call, 0.0, error=error)
    if bad.kind is m.DirectTargets:
        return m.DirectTargets(call, error=error)
    return None


def error_reply(bad: codec.UnreadableFrame, what: str) -> m.InferDone | None:
    """The answer to an Infer that cannot be read (None: ``bad`` is not one, or its
    request cannot be told)."""
    if bad.kind is not m.Infer or bad.ident is None:
        return None
    error = f"{what} sent {bad.what}: {bad.cause}"
    return m.InferDone(bad.ident, error=error, error_code=_INTERNAL)


def descriptors(bad: codec.UnreadableFrame) -> int:
    """How many descriptors the server sent beside ``bad`` (they must be taken off the
    descriptor socket, or the next frame's would be the wrong ones)."""
    if bad.kind is m.DirectAccept:
        return 1
    if bad.kind is m.DirectTargets and bad.fields.get("target"):
        return len(bad.fields.get("instances", []))
    return 0


def report(bad: codec.UnreadableFrame, what: str) -> None:
    """A frame nothing can be failed for: on stderr (the server's log), then dropped."""
    ident = "" if bad.ident is None else f" (id {bad.ident})"
    sys.stderr.write(f"dlserve worker: dropped {bad.what} from {what}{ident}: {bad.cause}\n")
    sys.stderr.flush()
