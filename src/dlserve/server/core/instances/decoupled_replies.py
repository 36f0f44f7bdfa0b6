"""A decoupled model's requests as the server sees them: any number of StreamResponse
frames per request, the last one final, and the notice that its ``execute`` returned.
Each worker handle owns one :class:`DecoupledStreams`, which shares its table of pending
requests (a decoupled request stays in it until it has had both)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dlserve import errors
from dlserve.ipc import messages as m
from dlserve.tensors.arena import Arena

if TYPE_CHECKING:
    from dlserve.server.core.instances.pending import Pending
    from dlserve.server.core.instances.replies import ReplyReader, WorkerReply


@dataclass(slots=True)
class StreamReply:
    """One response of a decoupled request: a reply or an error; ``final`` ends it."""

    reply: WorkerReply | None
    error: errors.DlserveError | None
    final: bool
    timings: m.Timings | None = None  # with the final one
    nbytes: int = 0  # what flow control counts of it (m.stream_bytes)


@dataclass(slots=True)
class StreamSink:
    """Where one decoupled request's responses go (its consumer), and who hears that its
    instance is free again: when ``execute`` has returned, or at the final response or the
    worker's death if those come first (once); and the timings of its ``execute``."""

    put: Callable[[StreamReply], None]
    lend: bool = False  # BLS: GPU and arena outputs stay lent to the caller
    on_free: Callable[[], None] | None = None
    on_executed: Callable[[m.Timings], None] | None = None
    abandoned: bool = False  # the consumer left: responses still coming are dropped
    freed: bool = False
    finished: bool = False  # the final response has come
    executed: bool = False  # the executed notice has come
    rescheduled: bool = False  # ... and said the model will run the request again
    # flow control: responses (and their bytes) the consumer took, not yet credited back
    taken: int = 0
    taken_bytes: int = 0

    def free(self) -> None:
        if not self.freed:
            self.freed = True
            if self.on_free is not None:
                self.on_free()

    def end(self, error: errors.DlserveError) -> None:
        """The request is over without its final response (it failed where it waited, or
        its worker died)."""
        if not (self.abandoned or self.finished):
            self.put(StreamReply(None, error, True))
        self.free()


class DecoupledStreams:
    """One worker's decoupled requests: their responses read (``reader``) and handed to
    their sinks, their inputs' arena space freed at the final response, and credit sent
    back (``send``) as their consumers take responses."""

    def __init__(
        self, pending: dict[int, Pending], input_arena: Arena, reader: ReplyReader,
        send: Callable[[m.ServerToWorker], None],
    ) -> None:  # fmt: skip
        self._pending = pending
        self._input_arena = input_arena
        self._reader = reader
        self._send = send

    def attach(self, rid: int, sink: StreamSink) -> None:
        """Request ``rid`` (just submitted) is decoupled: its StreamResponses go to ``sink``."""
        pending = self._pending.get(rid)
        if pending is not None:
            pending.stream = sink

    def on_response(self, msg: m.StreamResponse, payload: memoryview) -> None:
        """A response, or the executed notice; the request is forgotten once it has had
        both its final response and the notice (either may come first)."""
        pending = self._pending.get(msg.rid)
        if pending is None or pending.stream is None:
            return
        sink = pending.stream
        if msg.executed:
            sink.executed, sink.rescheduled = True, msg.rescheduled
            if sink.finished:
                del self._pending[msg.rid]
            if msg.timings is not None and sink.on_executed is not None:
                sink.on_executed(msg.timings)
            sink.free()
            return
        if msg.final:
            sink.finished = True
            if sink.executed:
                del self._pending[msg.rid]
            for offset in pending.arena_offsets:  # the model may read its inputs until now
                self._input_arena.free(offset)
            pending.arena_offsets = []
        if sink.abandoned:
            self._reader.discard_refs(msg.outputs)
        else:
            sink.put(self._stream_reply(msg, payload, sink.lend))
        if msg.final:
            sink.free()

    def _stream_reply(
        self, frame: m.StreamResponse, payload: memoryview, lend: bool
    ) -> StreamReply:
        if frame.error_code:
            error = errors.error_from_worker(frame.error, frame.error_code)
            return StreamReply(None, error, frame.final, frame.timings)
        if not frame.has_response:
            return StreamReply(None, None, frame.final, frame.timings)
        done = m.InferDone(frame.rid, frame.outputs, parameters=frame.parameters)
        return StreamReply(self._reader.read(done, payload, False, lend), None, frame.final,
                           frame.timings, m.stream_bytes(frame.outputs))  # fmt: skip

    def took(self, rid: int, sink: StreamSink, reply: StreamReply) -> None:
        """The consumer of request ``rid`` has taken ``reply``: the model may send one more.
        Credit goes back in batches (half the window), so a consumer that keeps up costs
        one small frame per WINDOW_RESPONSES / 2 responses, not one per response."""
        if reply.final:
            return
        sink.taken += 1
        sink.taken_bytes += reply.nbytes
        if sink.taken >= m.WINDOW_RESPONSES // 2 or sink.taken_bytes >= m.WINDOW_BYTES // 2:
            if rid in self._pending:
                self._send(m.Credit(rid, sink.taken, sink.taken_bytes))
            sink.taken = sink.taken_bytes = 0
