"""A decoupled model's requests as the server sees them (mixed into ``WorkerBase``): any
number of StreamResponse frames per request, the last one final; and Cancel frames for
requests whose client went away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dlserve import errors
from dlserve.ipc import messages as m
from dlserve.ipc.channel import AsyncChannel
from dlserve.tensors.shm import Arena

if TYPE_CHECKING:
    from dlserve.workers.client import Outcome, ReplyCallback, WorkerReply, WorkItem, _Pending


@dataclass(slots=True)
class StreamReply:
    """One response of a decoupled request: a reply or an error; ``final`` ends it."""

    reply: WorkerReply | None
    error: errors.DlserveError | None
    final: bool
    timings: m.Timings | None = None  # with the final one


class DecoupledStreams:
    """Mixed into WorkerBase, which provides these."""

    _channel: AsyncChannel[m.WorkerToServer] | None
    _pending: dict[int, _Pending]
    input_arena: Arena

    def submit(self, items: Sequence[WorkItem], callbacks: Sequence[ReplyCallback]) -> list[int]:
        raise NotImplementedError

    def read_reply(
        self, done: m.InferDone, payload: memoryview, *, keep: bool = False, lend: bool = False
    ) -> WorkerReply:
        raise NotImplementedError

    def release_outputs(self, offsets: list[int]) -> None:
        raise NotImplementedError

    def _on_stream_response(self, msg: m.StreamResponse, payload: memoryview) -> None:
        pending = self._pending.get(msg.rid)
        if pending is None or pending.stream is None:
            return
        if msg.final:
            del self._pending[msg.rid]
            for offset in pending.arena_offsets:  # the model may read its inputs until now
                self.input_arena.free(offset)
        pending.stream(msg, payload)

    async def infer_stream(self, item: WorkItem) -> AsyncGenerator[StreamReply, None]:
        """Run one request of a decoupled model: its responses as they come, the last one
        final. Leaving early (the client went away) tells the model: ``is_cancelled()``;
        responses still coming are dropped (their arena space goes back)."""
        queue: asyncio.Queue[StreamReply] = asyncio.Queue()
        abandoned = False

        def on_response(frame: m.StreamResponse, payload: memoryview) -> None:
            if abandoned:
                self.release_outputs(
                    [r.offset for r in frame.outputs if r.where == m.Where.OUTPUT_ARENA]
                )
                return
            queue.put_nowait(self._stream_reply(frame, payload, item.lend))

        def on_death(outcome: Outcome) -> None:  # a stream ends with StreamResponses only
            if isinstance(outcome, errors.DlserveError):
                queue.put_nowait(StreamReply(None, outcome, True))

        (rid,) = self.submit([item], [on_death])
        self._pending[rid].stream = on_response
        final = False
        try:
            while not final:
                reply = await queue.get()
                final = reply.final
                yield reply
        finally:
            if not final:
                abandoned = True
                self.cancel(rid)

    def _stream_reply(
        self, frame: m.StreamResponse, payload: memoryview, lend: bool
    ) -> StreamReply:
        if frame.error_code:
            error = errors.ModelError(frame.error, errors.ErrorCode(frame.error_code))
            return StreamReply(None, error, frame.final, frame.timings)
        if not frame.has_response:
            return StreamReply(None, None, frame.final, frame.timings)
        done = m.InferDone(frame.rid, frame.outputs, parameters=frame.parameters)
        return StreamReply(self.read_reply(done, payload, lend=lend), None, frame.final,
                           frame.timings)  # fmt: skip

    def cancel(self, rid: int) -> None:
        """The client of request ``rid`` has gone: the model sees ``is_cancelled()``, and
        a request that has not started is not run."""
        if self._channel is not None and rid in self._pending:
            self._channel.send(m.Cancel(rid))
