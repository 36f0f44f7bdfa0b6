"""What a streamed request is made of (gRPC ModelStreamInfer, BLS into a decoupled model):
its items, one per response, and the streams a model version has open (an unload waits
for them, and ends those that do not end in time). The request itself goes through
:mod:`dlserve.server.core.pipeline`.

Also the types a BLS request brings through the core (:class:`Call`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from dlserve import errors
from dlserve.server.core.instances.decoupled_replies import StreamReply, StreamSink
from dlserve.server.core.instances.handle import WorkerHandle
from dlserve.server.core.instances.replies import WorkerReply
from dlserve.server.core.shm.registry import RegionLease
from dlserve.types import InferRequest, InferResponse, OutputTensor

if TYPE_CHECKING:
    from dlserve.server.core.models.manager import ModelVersion


@dataclass(frozen=True, slots=True)
class Call:
    """What a BLS request brings besides the request: the models upstream of it (a cycle
    is refused) and where its inputs are when they travel by reference (client regions,
    the caller's arenas)."""

    chain: tuple[str, ...] = ()
    lease: RegionLease | None = None
    lend: bool = False  # outputs stay in the callee's memory for the caller to map


NO_CALL: Final = Call()


@dataclass(frozen=True, slots=True)
class StreamItem:
    """One response of a streamed request, or its failure; ``final`` ends the request."""

    response: InferResponse | None  # None with no error: a bare final flag
    error: errors.DlserveError | None
    final: bool
    model_version: str = ""


def stream_item(loaded: ModelVersion, request: InferRequest, each: StreamReply) -> StreamItem:
    """The item of one of a decoupled model's responses (or its bare final flag, or its
    failure)."""
    response = None
    if each.reply is not None:
        response = InferResponse(
            request.model_name, str(loaded.version), request.id,
            reply_outputs(loaded, each.reply), dict(each.reply.parameters),
        )  # fmt: skip
    return StreamItem(response, each.error, each.final, str(loaded.version))


class OpenStreams:
    """A model version's decoupled requests still streaming, and how to end each early:
    unloading waits for them (:meth:`drain`) as it waits for requests that execute."""

    def __init__(self) -> None:
        self._cuts: dict[int, Callable[[errors.DlserveError], None]] = {}
        self._none_left: asyncio.Event | None = None

    def open(self, key: int, cut: Callable[[errors.DlserveError], None]) -> None:
        self._cuts[key] = cut

    def close(self, key: int) -> None:
        self._cuts.pop(key, None)
        if not self._cuts and self._none_left is not None:
            self._none_left.set()

    async def drain(self, deadline: float, model: str) -> None:
        """Wait until every stream has ended, until ``deadline`` (monotonic seconds); end
        the ones still open with UNAVAILABLE (their clients read too slowly, or not at all,
        so their models wait for credit)."""
        while self._cuts and (remaining := deadline - time.monotonic()) > 0:
            self._none_left = asyncio.Event()
            try:
                await asyncio.wait_for(self._none_left.wait(), remaining)
            except TimeoutError:
                break
        failure = errors.UnavailableError(f"model '{model}' is being unloaded")
        for cut in list(self._cuts.values()):
            cut(failure)


def stream_cutter(
    sink: StreamSink, worker: WorkerHandle, rid: int
) -> Callable[[errors.DlserveError], None]:
    """How to end a stream early (its model is unloaded while its client reads too slowly):
    the consumer gets ``error`` as the final item, the model's responses still coming are
    dropped and it sees ``is_cancelled()`` (a send it waits in is released)."""

    def cut(error: errors.DlserveError) -> None:
        if not (sink.finished or sink.abandoned):
            sink.put(StreamReply(None, error, True))
        sink.abandoned = True
        worker.cancel(rid)

    return cut


def reply_outputs(loaded: ModelVersion, reply: WorkerReply) -> list[OutputTensor]:
    """A reply's outputs with the shapes the client sees; lent ones stay lent (BLS)."""
    if not loaded.validator.reshapes_outputs:  # the shapes are the model's own
        return reply.outputs
    shape = loaded.validator.output_shape
    return [
        OutputTensor(o.name, o.datatype, shape(o.name, o.shape), o.data, lent=o.lent)
        for o in reply.outputs
    ]
