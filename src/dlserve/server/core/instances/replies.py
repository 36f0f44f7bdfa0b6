"""What a worker's reply holds, as the core reads it (mixed into ``WorkerBase``): outputs
inline in the frame, in the worker's output arena (copied out, viewed in place, or lent
to a BLS caller) or lent GPU memory; and the output-arena space given back afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, cast

from dlserve import errors
from dlserve.ipc import messages as m
from dlserve.ipc.channel import AsyncChannel
from dlserve.tensors.arena import ShmSegment
from dlserve.types import ArenaSpan, CudaSpan, OutputTensor

if TYPE_CHECKING:
    from dlserve.server.core.instances.handle import WorkerBase

_PAYLOAD: Final = m.Where.PAYLOAD

# What becomes of one request sent to a worker: its reply frame, or the worker's death.
Outcome = tuple[m.InferDone, memoryview] | errors.DlserveError


@dataclass(slots=True)
class WorkerReply:
    outputs: list[OutputTensor]
    timings: m.Timings | None
    parameters: dict[str, m.ParamValue] = field(default_factory=dict)
    held: list[int] = field(default_factory=list)  # output-arena offsets still viewed
    worker: WorkerBase | None = None  # whose output arena ``held`` is in


class ReplyReading:
    """Mixed into WorkerBase, which provides these."""

    _channel: AsyncChannel[m.WorkerToServer] | None
    _release: list[int]
    _release_scheduled: bool
    output_segment: ShmSegment
    arena_ids: tuple[int, int]

    # ArenaLending's (annotations only: a method here would hide the real one)
    arena_span: Callable[[m.Where, int, int], ArenaSpan]
    release_lent: Callable[[int], None]

    def read_reply(
        self, done: m.InferDone, payload: memoryview, *, keep: bool = False, lend: bool = False
    ) -> WorkerReply:
        """The reply's outputs; raises the model's error. Outputs in the output arena are
        copied out, or with ``keep`` viewed in place and listed in ``held`` (give them
        back with :meth:`release_outputs` once nothing reads them), or with ``lend`` left
        for a BLS caller to map (``OutputTensor.lent``; it gives them back)."""
        if done.error_code:
            raise errors.error_from_worker(done.error, done.error_code)
        outputs = []
        held: list[int] = []
        data: bytes | memoryview | None
        for ref in done.outputs:
            where = ref.where
            if where == _PAYLOAD:  # the usual small output: a view of the frame
                data = payload[ref.offset : ref.offset + ref.nbytes]
                outputs.append(OutputTensor(ref.name, ref.datatype, tuple(ref.shape), data))
                continue
            lent: ArenaSpan | CudaSpan | None = None
            if where == m.Where.OUTPUT_ARENA and lend:
                data, lent = None, self.arena_span(m.Where.OUTPUT_ARENA, ref.offset, ref.nbytes)
            elif where == m.Where.CUDA_IPC:  # a GPU output lent to a BLS caller
                data = None
                lent = CudaSpan(ref.handle, ref.device, ref.offset, ref.nbytes, ref.lend,
                                self.arena_ids[1])  # fmt: skip
            elif where == m.Where.OUTPUT_ARENA:
                view = self.output_segment.buffer[ref.offset : ref.offset + ref.nbytes]
                if keep:
                    data = view
                    held.append(ref.offset)
                else:
                    data = bytes(view)
                    self._schedule_release(ref.offset)
            else:
                data = None
            shape = tuple(ref.shape)
            outputs.append(OutputTensor(ref.name, ref.datatype, shape, data, lent=lent))
        owner = cast("WorkerBase", self) if held else None
        return WorkerReply(outputs, done.timings, done.parameters, held, owner)

    def discard(self, outcome: Outcome) -> None:
        """A reply nobody will read: its output-arena space (and lent GPU outputs) go back
        to the worker."""
        if isinstance(outcome, tuple):
            outputs = outcome[0].outputs
            self.release_outputs([r.offset for r in outputs if r.where == m.Where.OUTPUT_ARENA])
            for ref in outputs:
                if ref.where == m.Where.CUDA_IPC and ref.lend:
                    self.release_lent(-ref.lend)

    def release_outputs(self, offsets: list[int]) -> None:
        for offset in offsets:
            self._schedule_release(offset)

    def _schedule_release(self, offset: int) -> None:
        """Output-arena space goes back with the next Infer, or in a Release of its own."""
        self._release.append(offset)
        if not self._release_scheduled:
            self._release_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_release)

    def _flush_release(self) -> None:
        self._release_scheduled = False
        if self._release and self._channel is not None:
            self._channel.send(m.Release(self._release))
            self._release = []
