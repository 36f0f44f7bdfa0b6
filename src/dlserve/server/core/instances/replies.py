"""A worker's reply read where it arrives: an InferDone frame becomes the core's
:class:`WorkerReply` once, in the handle, and the scheduler gets that finished outcome.

Outputs are inline in the frame (viewed), in the worker's output arena (copied out and
the space given back, viewed in place, or lent to a BLS caller), or GPU memory lent by
CUDA IPC handle; a reply nobody will read gives that memory back.

An output is copied out of the arena rather than sent from it so that the worker's space
never waits on a client's reading (a slow reader may hold a response until the send
timeout). A large one is copied in a thread (numpy's copy releases the GIL): on the
event loop, 256 MiB would hold every other client for a few hundred milliseconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from dlserve import errors
from dlserve.ipc import messages as m
from dlserve.server.core.instances.lending import ArenaLending, return_lent
from dlserve.tensors.arena import ShmSegment
from dlserve.tensors.copies import COPY_ON_LOOP_LIMIT, unlocked_copy
from dlserve.types import ArenaSpan, CudaSpan, OutputTensor

if TYPE_CHECKING:
    from dlserve.server.core.instances.handle import WorkerHandle

_PAYLOAD: Final = m.Where.PAYLOAD
_OUTPUT_ARENA: Final = m.Where.OUTPUT_ARENA
_CUDA_IPC: Final = m.Where.CUDA_IPC


@dataclass(slots=True)
class WorkerReply:
    """What a worker answered for one request: its outputs, or the model's error."""

    outputs: list[OutputTensor]
    timings: m.Timings | None
    parameters: dict[str, m.ParamValue] = field(default_factory=dict)
    held: list[int] = field(default_factory=list)  # output-arena offsets still viewed
    worker: WorkerHandle | None = None  # whose output arena ``held`` is in
    error: errors.DlserveError | None = None  # the model's error (no outputs then)
    deferred: bool = False  # a notice: execute returned, the response comes later
    rescheduled: bool = False  # the model runs the request again (iterative sequences)


# What becomes of one request sent to a worker: its reply, read, or the worker's death.
Outcome = WorkerReply | errors.DlserveError


class ReplyReader:
    """Reads one worker's replies. Output-arena space goes back through ``release`` (the
    handle batches it into its next frame); lent outputs are made and taken back by
    ``lending``; ``owner`` is the handle a reply that holds output-arena space names."""

    def __init__(
        self, owner: WorkerHandle, output_segment: ShmSegment, lending: ArenaLending,
        release: Callable[[int], None],
    ) -> None:  # fmt: skip
        self._owner = owner
        self._output_segment = output_segment
        self._lending = lending
        self._release = release
        self._copying: set[asyncio.Task[None]] = set()  # copies under way (referenced)

    def deliver(
        self, done: m.InferDone, payload: memoryview, keep: bool, lend: bool,
        callback: Callable[[Outcome], None],
    ) -> None:  # fmt: skip
        """``callback`` gets the reply ``done`` carries (:meth:`read`): at once, or, when
        it has an output to copy out of the output arena larger than
        ``COPY_ON_LOOP_LIMIT``, once a thread has copied it."""
        later: list[tuple[int, int, memoryview]] = []
        reply = self.read(done, payload, keep, lend, later)
        if not later:
            callback(reply)
            return
        task = asyncio.get_running_loop().create_task(self._copy_out(reply, later, callback))
        self._copying.add(task)
        task.add_done_callback(self._copying.discard)

    async def _copy_out(
        self, reply: WorkerReply, later: list[tuple[int, int, memoryview]],
        callback: Callable[[Outcome], None],
    ) -> None:  # fmt: skip
        """Copy the outputs ``later`` lists in a thread, give their space back, then hand
        on the reply."""
        outcome: Outcome = reply
        views = [view for _, _, view in later]
        try:
            copies = await asyncio.get_running_loop().run_in_executor(None, _copied, views)
            for (index, _, _), data in zip(later, copies, strict=True):
                reply.outputs[index].data = data
        except Exception as exc:  # out of memory: this request fails, not the server
            outcome = errors.InternalError(f"copying the model's outputs failed: {exc!r}")
        finally:  # cancelled too (the loop is closing): the worker gets its space back
            for _, offset, _ in later:
                self._release(offset)
        callback(outcome)

    def read(
        self, done: m.InferDone, payload: memoryview, keep: bool, lend: bool,
        later: list[tuple[int, int, memoryview]] | None = None,
    ) -> WorkerReply:  # fmt: skip
        """The reply ``done`` carries. Outputs in the output arena are copied out, or with
        ``keep`` viewed in place and listed in ``held`` (the handle's ``release_outputs``
        gives them back once nothing reads them), or with ``lend`` left for a BLS caller
        to map (``OutputTensor.lent``; it gives them back). ``later``: where an output to
        copy larger than ``COPY_ON_LOOP_LIMIT`` is left a view, listed (its index in the
        outputs, its offset, the view) for the caller to copy and give back (:meth:`deliver`)."""
        if done.error_code:
            error = errors.error_from_worker(done.error, done.error_code)
            return WorkerReply([], done.timings, error=error, rescheduled=done.rescheduled)
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
            if where == _OUTPUT_ARENA and lend:
                data, lent = None, self._lending.arena_span(_OUTPUT_ARENA, ref.offset, ref.nbytes)
            elif where == _CUDA_IPC:  # a GPU output lent to a BLS caller
                data = None
                lent = CudaSpan(ref.handle, ref.device, ref.offset, ref.nbytes, ref.lend,
                                self._lending.arena_ids[1])  # fmt: skip
            elif where == _OUTPUT_ARENA:
                view = self._output_segment.buffer[ref.offset : ref.offset + ref.nbytes]
                if keep:
                    data = view
                    held.append(ref.offset)
                elif later is not None and ref.nbytes > COPY_ON_LOOP_LIMIT:
                    data = view
                    later.append((len(outputs), ref.offset, view))
                else:
                    data = bytes(view)
                    self._release(ref.offset)
            else:
                data = None
            shape = tuple(ref.shape)
            outputs.append(OutputTensor(ref.name, ref.datatype, shape, data, lent=lent))
        owner = self._owner if held else None
        return WorkerReply(outputs, done.timings, done.parameters, held, owner, None, False,
                           done.rescheduled)  # fmt: skip

    def discard(self, outcome: Outcome) -> None:
        """A reply nobody will use: what it holds of the output arena, and what it lends,
        goes back to the worker."""
        if isinstance(outcome, WorkerReply):
            for offset in outcome.held:
                self._release(offset)
            return_lent(outcome.outputs)

    def discard_refs(self, refs: Iterable[m.TensorRef]) -> None:
        """Outputs of a frame that will not be read (its request is gone, or the frame
        is unreadable): their output-arena space and lent GPU memory go back."""
        for ref in refs:
            if ref.where == _OUTPUT_ARENA:
                self._release(ref.offset)
            elif ref.where == _CUDA_IPC and ref.lend:
                self._lending.release_lent(-ref.lend)


def _copied(views: list[memoryview]) -> list[memoryview]:
    """Copies of ``views``, made on a thread."""
    return [unlocked_copy(view) for view in views]
