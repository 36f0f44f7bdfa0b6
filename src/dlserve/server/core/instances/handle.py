"""The server's handle on one worker: start it, send it requests, notice its death.

:class:`WorkerBase` is what the core talks to; ``kinds.py`` holds the two ways to run the
worker (its own process, or a thread of the server). Both speak the same frames. A
worker's own calls (metrics, BLS) come in on the same connection; the memory workers lend
each other for BLS is in ``lending.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from dlserve import errors
from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.ipc.channel import AsyncChannel
from dlserve.ipc.log_environment import log_settings_env
from dlserve.server.core.instances import polling, unreadable
from dlserve.server.core.instances.lending import ARENA_OWNERS, ArenaLending
from dlserve.server.core.instances.placement import (
    NO_SPANS,
    Placed,
    Span,
    infer_message,
    place_inputs,
    replace_inputs,
)
from dlserve.server.core.instances.replies import Outcome, ReplyReading, WorkerReply
from dlserve.server.core.instances.streams import DecoupledStreams, StreamSink
from dlserve.tensors.arena import Arena, ShmSegment
from dlserve.types import InputTensor

INPUT_ARENA_SIZE: Final = 256 * 1024 * 1024
OUTPUT_ARENA_SIZE: Final = 256 * 1024 * 1024
REAP_TIMEOUT_S: Final = 1.0  # how long a dead worker's exit status is waited for
_worker_ids = itertools.count()


@dataclass(slots=True)
class WorkItem:
    """One request as an instance receives it. Inputs without data are in client
    regions (``input_spans``, by name); outputs named in ``output_spans`` are written
    into client regions."""

    request_id: str
    inputs: list[InputTensor]
    outputs: list[str]  # requested output names; empty: all the model produces
    parameters: dict[str, m.ParamValue]
    input_spans: Mapping[str, Span] = field(default_factory=dict)
    output_spans: Mapping[str, Span] = field(default_factory=dict)
    chain: list[str] = field(default_factory=list)  # BLS: the instances upstream of it
    lend: bool = False  # BLS: outputs stay in the worker's memory for the caller to map
    correlation_id: int | str = 0  # the sequence id (0: none)
    flags: int = 0  # SEQUENCE_START 1, SEQUENCE_END 2
    trace_id: int = 0  # the request's trace (0: not traced): request.trace() names it
    timeout_us: int = 0  # the request's timeout (0: none): request.timeout() returns it


ReplyCallback = Callable[[Outcome], None]


@dataclass(slots=True)
class _Pending:
    callback: ReplyCallback
    arena_offsets: list[int]
    stream: StreamSink | None = None  # decoupled: where its responses go
    refs: list[m.TensorRef] | None = None  # where its inputs were placed (rescheduling)
    notices: bool = False  # the callback also hears a ``deferred`` notice


class CallSink(Protocol):
    """Where a worker's BLS and model-control calls go (the core)."""

    def on_bls(self, caller: WorkerBase, msg: m.BlsCall, payload: memoryview) -> None: ...

    def on_control(self, caller: WorkerBase, msg: m.ControlCall) -> None: ...

    def on_bls_credit(self, caller: WorkerBase, msg: m.BlsCredit) -> None: ...

    def on_direct(self, worker: WorkerBase, msg: DirectMessage) -> None:
        """A worker's frame about direct BLS calls (``server/core/calls/direct_broker.py``)."""


MetricMessage = m.MetricFamilyDef | m.MetricOp | m.MetricValueCall
DirectMessage = m.DirectOpen | m.DirectStats | m.DirectMapped
_DIRECT: Final = (m.DirectOpen, m.DirectStats, m.DirectMapped)


def apply_log_settings(settings: m.LogSettings) -> None:
    """New log settings for model code: workers started from now on inherit them (this
    process's environment; in-process workers read it too), running ones are told."""
    os.environ.update(
        log_settings_env(
            settings.verbose, settings.info, settings.warning, settings.error, settings.iso8601
        )
    )
    told: set[int] = set()
    for worker in list(ARENA_OWNERS.values()):
        if isinstance(worker, WorkerBase) and id(worker) not in told:
            told.add(id(worker))
            worker.tell(settings)


MetricSink = Callable[[MetricMessage], m._Msg | None]


class WorkerBase(ReplyReading, ArenaLending, DecoupledStreams):
    """Shared logic of both worker kinds; subclasses only start and stop the other side."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.model_name = ""  # the model it runs, once loaded
        base_name = f"dlserve_{os.getpid()}_{next(_worker_ids)}"
        # memfds, handed to the worker at spawn; no name exists to be left behind
        self.input_segment = ShmSegment.anonymous(f"{base_name}_in", INPUT_ARENA_SIZE)
        self.output_segment = ShmSegment.anonymous(f"{base_name}_out", OUTPUT_ARENA_SIZE)
        self.input_arena = Arena(self.input_segment)
        self._start_lending(self.input_segment, self.output_segment)
        self._channel: AsyncChannel[m.WorkerToServer] | None = None
        self._fd_socket: socket.socket | None = None  # descriptors to the worker (direct BLS)
        self._pending: dict[int, _Pending] = {}
        self._kept: dict[int, _Pending] = {}  # rescheduled, between two executes (inputs)
        self._rids = itertools.count(1)
        self._control: asyncio.Future[m.WorkerToServer] | None = None
        self._release: list[int] = []
        self._release_scheduled = False
        self.closed: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.on_metric: MetricSink | None = None
        self.calls: CallSink | None = None

    async def spawn(self, env: dict[str, str] | None = None) -> None:
        raise NotImplementedError

    # -- connection ---------------------------------------------------------------------
    def _descriptor_socket(self) -> socket.socket:
        """A socketpair for handing the worker descriptors (one message each, with its
        descriptors: SOCK_SEQPACKET keeps them apart); returns the worker's end."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        self._fd_socket = ours
        return theirs

    def send_with_fds(self, msg: m.ServerToWorker, fds: list[int]) -> bool:
        """Send ``msg`` with descriptors beside it (the worker picks them up when it reads
        ``msg``); False when the worker cannot take them (gone, or not reading)."""
        if self._channel is None or self._fd_socket is None:
            return False
        try:
            socket.send_fds(self._fd_socket, [b"d"], fds)
        except OSError:  # BlockingIOError: it has not picked up earlier ones
            return False
        self._channel.send(msg)
        return True

    async def _connect(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_unix_connection(
            lambda: AsyncChannel(codec.to_server, self._on_frame, self._on_lost,
                                 self._on_unreadable), sock=sock,
        )  # fmt: skip
        self._channel = protocol

    def _on_unreadable(self, bad: codec.UnreadableFrame) -> None:
        """A frame that cannot be read fails what it belongs to (``unreadable.py``); the
        connection goes on. An answer to Load that cannot be read fails the load."""
        if bad.kind in (m.Loaded, m.LoadFailed):
            failed = m.LoadFailed(unreadable.describe(self, bad))
            if self._control is not None and not self._control.done():
                self._control.set_result(failed)
            return
        unreadable.handle(self, bad)

    def _on_frame(self, msg: m.WorkerToServer, payload: memoryview) -> None:
        if isinstance(msg, m.InferDone):
            if msg.deferred:  # execute returned; the response (and the inputs' end) later
                self._on_deferred(msg, payload)
                return
            pending = self._pending.pop(msg.rid, None)
            if pending is not None:
                if msg.rescheduled:  # its inputs stay where they are for its next execute
                    self._kept[msg.rid] = pending
                else:
                    for offset in pending.arena_offsets:
                        self.input_arena.free(offset)
                pending.callback((msg, payload))
            if msg.direct and self.calls is not None:
                self.calls.on_direct(self, m.DirectStats(msg.direct))
        elif isinstance(msg, m.StreamResponse):
            self._on_stream_response(msg, payload)
        elif isinstance(msg, m.MetricFamilyDef | m.MetricOp | m.MetricValueCall):
            self._on_metric_message(msg)
        elif isinstance(msg, m.BlsCall):
            if self.calls is not None:
                self.calls.on_bls(self, msg, payload)
        elif isinstance(msg, m.ControlCall):
            if self.calls is not None:
                self.calls.on_control(self, msg)
        elif isinstance(msg, m.BlsCredit):
            if self.calls is not None:
                self.calls.on_bls_credit(self, msg)
        elif isinstance(msg, _DIRECT):
            if self.calls is not None:
                self.calls.on_direct(self, msg)
        elif isinstance(msg, m.PeerRelease):
            for arena, offset in zip(msg.arenas, msg.offsets, strict=True):
                self.give_back(arena, offset)
        elif self._control is not None and not self._control.done():
            self._control.set_result(msg)

    def _on_deferred(self, msg: m.InferDone, payload: memoryview) -> None:
        pending = self._pending.get(msg.rid)
        if pending is not None and pending.notices:
            pending.callback((msg, payload))
        if msg.direct and self.calls is not None:
            self.calls.on_direct(self, m.DirectStats(msg.direct))

    def send_answer(
        self,
        msg: m.BlsReply | m.ControlReply | m.DirectTargets | m.MetricValueReply,
        payload: list[memoryview],
    ) -> None:
        """Answer a call this worker made (dropped when it has died meanwhile)."""
        if self._channel is not None:
            self._channel.send(msg, payload)

    def _on_metric_message(self, msg: MetricMessage) -> None:
        if self.on_metric is None:
            return
        reply = self.on_metric(msg)
        if reply is not None and self._channel is not None:
            self._channel.send(reply)

    def _on_lost(self, exc: Exception | None) -> None:
        self._channel = None
        asyncio.get_running_loop().create_task(self._fail_everything())

    async def _fail_everything(self) -> None:
        """Fail what was in flight, with the exit status once the process is reaped."""
        await self._reaped(REAP_TIMEOUT_S)
        reason = self.death_reason()
        failure = errors.WorkerDiedError(reason)
        pending, self._pending = self._pending, {}
        for one in pending.values():
            one.callback(failure)
        if self._control is not None and not self._control.done():
            self._control.set_exception(failure)
        self._give_back_all()  # what it mapped of other workers' outputs
        if not self.closed.done():
            self.closed.set_result(reason)

    def death_reason(self) -> str:
        return errors.not_healthy(self.label)

    async def _reaped(self, timeout: float) -> None:
        """Wait (briefly) for the other side to be gone for good."""

    # -- load ---------------------------------------------------------------------------
    async def load(self, msg: m.Load, timeout: float) -> m.Loaded:
        """Send Load and wait for the answer; raises UnavailableError with the reason."""
        self.label = msg.instance_name or self.label  # a reused worker becomes this instance
        self.model_name = msg.model_name
        reply = await self._control_call(msg, timeout, "loading")
        if isinstance(reply, m.LoadFailed):
            raise errors.UnavailableError(reply.message)
        if not isinstance(reply, m.Loaded):
            raise errors.InternalError(f"unexpected reply to Load: {type(reply).__name__}")
        return reply

    async def _control_call(self, msg: m._Msg, timeout: float, what: str) -> m.WorkerToServer:
        if self._channel is None:
            raise errors.WorkerDiedError(self.death_reason())
        self._control = asyncio.get_running_loop().create_future()
        self._channel.send(msg)
        try:
            return await asyncio.wait_for(self._control, timeout)
        except TimeoutError:
            raise errors.DeadlineExceededError(
                f"model instance '{self.label}' did not finish {what} within {timeout:g} s"
            ) from None
        finally:
            self._control = None

    # -- inference ----------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._channel is not None

    async def infer(
        self,
        request_id: str,
        inputs: list[InputTensor],
        outputs: list[str],
        parameters: dict[str, m.ParamValue],
        input_spans: Mapping[str, Span] = NO_SPANS,
        output_spans: Mapping[str, Span] = NO_SPANS,
    ) -> WorkerReply:
        """Run one request now (see :class:`WorkItem`), whatever else is in flight."""
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()

        def resolve(outcome: Outcome) -> None:
            if future.done():  # its caller gave up: the reply's arena space goes back
                self.discard(outcome)
            else:
                future.set_result(outcome)

        item = WorkItem(request_id, inputs, outputs, parameters, input_spans, output_spans)
        (rid,) = self.submit([item], [resolve])
        try:
            outcome = await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.discard(future.result())
            else:
                self.cancel(rid)  # the model sees is_cancelled()
            raise
        if isinstance(outcome, errors.DlserveError):
            raise outcome
        return self.read_reply(*outcome)

    def submit(
        self, items: Sequence[WorkItem], callbacks: Sequence[ReplyCallback],
        rids: Sequence[int | None] = (), *, notices: bool = False,
    ) -> list[int]:  # fmt: skip
        """Send ``items`` for one ``execute`` call; each callback gets its item's outcome
        (called from the event loop, once). Returns their rids. Raises WorkerDiedError when
        the worker is gone. ``rids``: a rescheduled request's rid, per item (None: a new
        one): it keeps its inputs where they were placed (and a decoupled one its stream)
        until it is done, or :meth:`forget` is called. ``notices``: a callback is also
        called, before the outcome, with a ``deferred`` InferDone when the execute returned
        without the request's response (its model sends it later)."""
        channel = self._channel
        if channel is None:
            raise errors.WorkerDiedError(self.death_reason())
        payload: list[memoryview] = []
        inline = 0
        placed: list[Placed] = []
        pendings: list[_Pending] = []
        reused: list[int] = []  # rids taken out of _kept
        try:
            for item, callback in zip(items, callbacks, strict=True):
                rid = rids[len(placed)] if rids else None
                earlier = None if rid is None else self._earlier(rid)
                if earlier is not None and earlier.refs is not None:  # placed already
                    refs, inline = replace_inputs(earlier.refs, item.inputs, payload, inline)
                    pending = _Pending(callback, earlier.arena_offsets, earlier.stream, refs)
                    offsets: list[int] = []
                    if earlier.stream is None and rid is not None:
                        reused.append(rid)
                else:
                    refs, inline, offsets = place_inputs(
                        self.input_arena, item.inputs, item.input_spans, payload, inline
                    )
                    pending = _Pending(callback, offsets, refs=refs, notices=notices)
                placed.append((next(self._rids) if rid is None else rid, item, refs, offsets))
                pendings.append(pending)
        except BaseException:
            for (rid, _, _, offsets), pending in zip(placed, pendings, strict=True):
                for offset in offsets:  # placed now: freed; placed earlier: kept again
                    self.input_arena.free(offset)
                if rid in reused:
                    self._kept[rid] = pending
            raise
        sent: list[int] = []
        for (rid, _, _, _), pending in zip(placed, pendings, strict=True):
            self._pending[rid] = pending
            sent.append(rid)
        if polling.active():
            polling.spinner.hold(self._pending)
        release = self._release
        if release:
            self._release = []
        channel.send(infer_message(placed, release), payload)
        return sent

    def _earlier(self, rid: int) -> _Pending | None:
        """A rescheduled request's placement: kept since its InferDone, or (decoupled) its
        pending entry, which lives until its final response."""
        return self._kept.pop(rid, None) or self._pending.get(rid)

    def forget(self, rid: int) -> None:
        """A rescheduled request will not run again: its inputs' arena space goes back."""
        pending = self._kept.pop(rid, None) or self._pending.pop(rid, None)
        if pending is not None:
            for offset in pending.arena_offsets:
                self.input_arena.free(offset)

    def tell(self, message: m.ServerToWorker) -> None:
        """Send a notice that wants no answer (the worker may be between requests or not)."""
        if self._channel is not None:
            self._channel.send(message)

    def unmap_regions(self, regions: list[int]) -> None:
        """These client regions are gone: the worker drops its mappings of them."""
        if self._channel is not None:
            self._channel.send(m.UnmapRegions(regions))

    # -- stop ---------------------------------------------------------------------------
    async def stop(self, timeout: float) -> None:
        """Ask the worker to finalize and exit; kill it past the deadline."""
        if self._channel is not None:
            try:
                await self._control_call(m.Shutdown(), timeout, "finalize")
            except errors.DlserveError:
                pass
        await self._terminate(timeout)
        self._cleanup_shm()

    async def _terminate(self, timeout: float) -> None:
        raise NotImplementedError

    def _cleanup_shm(self) -> None:
        if self._fd_socket is not None:
            self._fd_socket.close()
            self._fd_socket = None
        self._stop_lending()
        self.input_segment.close()
        self.output_segment.close()
