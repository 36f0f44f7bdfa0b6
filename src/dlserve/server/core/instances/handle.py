"""The server's handle on one worker: start it, send it requests, read its replies,
notice its death.

:class:`WorkerHandle` is what the core talks to. It owns its collaborators: a launcher
(``process.py`` or ``thread.py``: how the other side runs), a :class:`ReplyReader`
(``replies.py``: a reply read where it arrives), its :class:`ArenaLending` (``lending.py``:
the memory workers lend each other for BLS) and its :class:`DecoupledStreams`
(``decoupled_replies.py``). A worker's own calls (metrics, BLS, model control) come in on the same
connection; each kind of frame has its handler in one table.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from dlserve import errors
from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.ipc.channel import AsyncChannel
from dlserve.ipc.log_environment import log_settings_env
from dlserve.server.core.instances import polling, unreadable
from dlserve.server.core.instances.decoupled_replies import DecoupledStreams
from dlserve.server.core.instances.lending import ArenaLending
from dlserve.server.core.instances.pending import Pending, ReplyCallback
from dlserve.server.core.instances.placement import (
    NO_SPANS,
    Placed,
    Span,
    infer_message,
    place_inputs,
    replace_inputs,
)
from dlserve.server.core.instances.replies import Outcome, ReplyReader, WorkerReply
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
    keep: bool = False  # outputs in the output arena are viewed in place (an ensemble step's)


class CallSink(Protocol):
    """Where a worker's BLS and model-control calls go (the core)."""

    def on_bls(self, caller: WorkerHandle, msg: m.BlsCall, payload: memoryview) -> None: ...

    def on_control(self, caller: WorkerHandle, msg: m.ControlCall) -> None: ...

    def on_bls_credit(self, caller: WorkerHandle, msg: m.BlsCredit) -> None: ...

    def on_direct(self, worker: WorkerHandle, msg: DirectMessage) -> None:
        """A worker's frame about direct BLS calls (``server/core/calls/direct_broker.py``)."""


class Launcher(Protocol):
    """How the other side of a handle runs: a process of its own or a thread."""

    @property
    def pid(self) -> int | None: ...

    async def start(
        self, label: str, channel: socket.socket, descriptors: socket.socket,
        arenas: tuple[ShmSegment, ShmSegment], env: dict[str, str] | None,
    ) -> None:  # fmt: skip
        """Start the worker on the other ends of its channel and descriptor socket (it
        owns them from now on) with its (input, output) arenas."""

    def ending(self) -> str:
        """How the worker ended ("exited with code 1"); "" when not known."""

    async def reaped(self, timeout: float) -> None:
        """Wait (briefly) for the other side to be gone for good."""

    async def terminate(self, timeout: float) -> None:
        """Wait for the other side to end after Shutdown; force it past ``timeout``."""


MetricMessage = m.MetricFamilyDef | m.MetricOp | m.MetricValueCall
MetricSink = Callable[[MetricMessage], m._Msg | None]
DirectMessage = m.DirectOpen | m.DirectStats | m.DirectMapped
FrameHandler = Callable[[Any, memoryview], None]  # one kind of m.WorkerToServer


def _ignore(msg: m.WorkerToServer, payload: memoryview) -> None:
    """A frame that is no business of the server's."""


_HANDLES: Final[weakref.WeakSet[WorkerHandle]] = weakref.WeakSet()  # every handle not stopped


def apply_log_settings(settings: m.LogSettings) -> None:
    """New log settings for model code: workers started from now on inherit them (this
    process's environment; in-process workers read it too), running ones are told."""
    os.environ.update(
        log_settings_env(
            settings.verbose, settings.info, settings.warning, settings.error, settings.iso8601
        )
    )
    for worker in list(_HANDLES):
        worker.tell(settings)


class WorkerHandle:
    """One worker, as the core sees it; ``launcher`` runs the other side."""

    def __init__(
        self, label: str, launcher: Launcher, *, on_metric: MetricSink | None = None,
        calls: CallSink | None = None,
    ) -> None:  # fmt: skip
        self.label = label
        self.model_name = ""  # the model it runs, once loaded
        self._launcher = launcher
        self._on_metric = on_metric
        self._calls = calls
        base_name = f"dlserve_{os.getpid()}_{next(_worker_ids)}"
        # memfds, handed to the worker at spawn; no name exists to be left behind
        self.input_segment = ShmSegment.anonymous(f"{base_name}_in", INPUT_ARENA_SIZE)
        self.output_segment = ShmSegment.anonymous(f"{base_name}_out", OUTPUT_ARENA_SIZE)
        self.input_arena = Arena(self.input_segment)
        self._channel: AsyncChannel[m.WorkerToServer] | None = None
        self.alive = False  # connected: it can take requests
        self._fd_socket: socket.socket | None = None  # descriptors to the worker (direct BLS)
        self._pending: dict[int, Pending] = {}
        self._kept: dict[int, Pending] = {}  # rescheduled, between two executes (inputs)
        self._rids = itertools.count(1)
        self._control: asyncio.Future[m.WorkerToServer] | None = None
        self._release: list[int] = []  # output-arena offsets to give back
        self._release_scheduled = False
        self.closed: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._compose()
        _HANDLES.add(self)

    def _compose(self) -> None:
        """The collaborators, what the core asks of them (bound here: no call of the
        handle's own on the way), and the table of frame handlers."""
        self._lending = ArenaLending(
            self.input_segment, self.output_segment, self._schedule_release, self.tell
        )
        self._reader = ReplyReader(self, self.output_segment, self._lending, self._schedule_release)
        self._streams = DecoupledStreams(self._pending, self.input_arena, self._reader, self.tell)
        self.discard = self._reader.discard  # a reply nobody will use
        self.attach_stream = self._streams.attach
        self.took = self._streams.took
        self.arena_ids = self._lending.arena_ids
        self.arena_paths = self._lending.arena_paths
        self.arena_span = self._lending.arena_span
        self.borrow = self._lending.borrow
        self.release_staged = self._lending.release_staged
        self._handlers = self._frame_handlers()

    def _frame_handlers(self) -> dict[type, FrameHandler]:
        """The handler of each frame a worker sends the server (``m.WorkerToServer``)."""
        on_metric, on_direct, on_answer = self._on_metric_message, self._on_direct, self._on_answer
        return {
            m.InferDone: self._on_infer_done,
            m.StreamResponse: self._streams.on_response,
            m.PeerRelease: self._lending.on_peer_release,
            m.MetricFamilyDef: on_metric, m.MetricOp: on_metric, m.MetricValueCall: on_metric,
            m.BlsCall: self._on_bls, m.ControlCall: self._on_control, m.BlsCredit: self._on_credit,
            m.DirectOpen: on_direct, m.DirectStats: on_direct, m.DirectMapped: on_direct,
            m.Loaded: on_answer, m.LoadFailed: on_answer, m.Closed: on_answer,
            m.DirectBye: _ignore,  # travels between workers only (direct BLS connections)
        }  # fmt: skip

    @property
    def pid(self) -> int | None:
        """The worker's process (None: a thread of this one)."""
        return self._launcher.pid

    # -- connection ---------------------------------------------------------------------
    async def spawn(self, env: dict[str, str] | None = None) -> None:
        """Start the worker and connect to it. A socketpair carries frames; another hands
        it descriptors, one message each with its descriptors (SOCK_SEQPACKET keeps them
        apart)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fds_ours, fds_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds_ours.setblocking(False)
        self._fd_socket = fds_ours
        arenas = (self.input_segment, self.output_segment)
        try:
            await self._launcher.start(self.label, theirs, fds_theirs, arenas, env)
        except BaseException:
            ours.close()
            raise
        await self._connect(ours)

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
        self.alive = True

    def _on_frame(self, msg: m.WorkerToServer, payload: memoryview) -> None:
        self._handlers[type(msg)](msg, payload)

    def _on_unreadable(self, bad: codec.UnreadableFrame) -> None:
        """A frame that cannot be read fails what it belongs to (``unreadable.py``); the
        connection goes on. An answer to Load that cannot be read fails the load."""
        if bad.kind in (m.Loaded, m.LoadFailed):
            self._on_answer(m.LoadFailed(unreadable.describe(self, bad)), bad.payload)
            return
        stand_in = unreadable.stand_in(self, bad, self._reader.discard_refs)
        if stand_in is not None:
            self._on_frame(stand_in, bad.payload)

    # -- frames -------------------------------------------------------------------------
    def _on_infer_done(self, msg: m.InferDone, payload: memoryview) -> None:
        """A request's reply, read here: its callback gets the finished outcome. Or the
        notice that its execute returned without it (``deferred``: the model sends it later)."""
        if msg.deferred:
            pending = self._pending.get(msg.rid)
            if pending is not None and pending.notices:
                pending.callback(WorkerReply([], msg.timings, deferred=True))
        else:
            pending = self._pending.pop(msg.rid, None)
            if pending is not None:
                if msg.rescheduled:  # its inputs stay where they are for its next execute
                    self._kept[msg.rid] = pending
                else:
                    for offset in pending.arena_offsets:
                        self.input_arena.free(offset)
                self._reader.deliver(msg, payload, pending.keep, pending.lend, pending.callback)
        if msg.direct and self._calls is not None:
            self._calls.on_direct(self, m.DirectStats(msg.direct))

    def _on_metric_message(self, msg: MetricMessage, payload: memoryview) -> None:
        if self._on_metric is None:
            return
        reply = self._on_metric(msg)
        if reply is not None and self._channel is not None:
            self._channel.send(reply)

    def _on_bls(self, msg: m.BlsCall, payload: memoryview) -> None:
        if self._calls is not None:
            self._calls.on_bls(self, msg, payload)

    def _on_control(self, msg: m.ControlCall, payload: memoryview) -> None:
        if self._calls is not None:
            self._calls.on_control(self, msg)

    def _on_credit(self, msg: m.BlsCredit, payload: memoryview) -> None:
        if self._calls is not None:
            self._calls.on_bls_credit(self, msg)

    def _on_direct(self, msg: DirectMessage, payload: memoryview) -> None:
        if self._calls is not None:
            self._calls.on_direct(self, msg)

    def _on_answer(self, msg: m.WorkerToServer, payload: memoryview) -> None:
        """The answer to the control call in flight (Load, Shutdown)."""
        if self._control is not None and not self._control.done():
            self._control.set_result(msg)

    def send_answer(
        self,
        msg: m.BlsReply | m.ControlReply | m.DirectTargets | m.MetricValueReply,
        payload: list[memoryview],
    ) -> None:
        """Answer a call this worker made (dropped when it has died meanwhile)."""
        if self._channel is not None:
            self._channel.send(msg, payload)

    def tell(self, message: m.ServerToWorker) -> None:
        """Send a notice that wants no answer (the worker may be between requests or not)."""
        if self._channel is not None:
            self._channel.send(message)

    def unmap_regions(self, regions: list[int]) -> None:
        """These client regions are gone: the worker drops its mappings of them."""
        self.tell(m.UnmapRegions(regions))

    # -- death --------------------------------------------------------------------------
    def _on_lost(self, exc: Exception | None) -> None:
        self._channel = None
        self.alive = False
        asyncio.get_running_loop().create_task(self._fail_everything())

    async def _fail_everything(self) -> None:
        """Fail what was in flight, with the exit status once the process is reaped."""
        await self._launcher.reaped(REAP_TIMEOUT_S)
        reason = self.death_reason()
        failure = errors.WorkerDiedError(reason)
        pending = list(self._pending.values())
        self._pending.clear()  # the table its streams share: cleared, not replaced
        for one in pending:
            one.callback(failure)
        if self._control is not None and not self._control.done():
            self._control.set_exception(failure)
        self._lending.give_back_all()  # what it mapped of other workers' outputs
        if not self.closed.done():
            self.closed.set_result(reason)

    def death_reason(self) -> str:
        return errors.not_healthy(self.label, self._launcher.ending())

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
    async def infer(
        self,
        request_id: str,
        inputs: list[InputTensor],
        outputs: list[str],
        parameters: dict[str, m.ParamValue],
        input_spans: Mapping[str, Span] = NO_SPANS,
        output_spans: Mapping[str, Span] = NO_SPANS,
    ) -> WorkerReply:
        """Run one request now (see :class:`WorkItem`), whatever else is in flight; raises
        the model's error."""
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
        if outcome.error is not None:
            raise outcome.error
        return outcome

    def submit(
        self, items: Sequence[WorkItem], callbacks: Sequence[ReplyCallback],
        rids: Sequence[int | None] = (), *, notices: bool = False,
    ) -> list[int]:  # fmt: skip
        """Send ``items`` for one ``execute`` call; each callback gets its item's outcome,
        read (called from the event loop, once). Returns their rids. Raises WorkerDiedError
        when the worker is gone. ``rids``: a rescheduled request's rid, per item (None: a
        new one): it keeps its inputs where they were placed (and a decoupled one its
        stream) until it is done, or :meth:`forget` is called. ``notices``: a callback is
        also called, before the outcome, with a ``deferred`` reply when the execute
        returned without the request's response (its model sends it later)."""
        channel = self._channel
        if channel is None:
            raise errors.WorkerDiedError(self.death_reason())
        payload: list[memoryview] = []
        inline = 0
        placed: list[Placed] = []
        pendings: list[Pending] = []
        reused: list[int] = []  # rids taken out of _kept
        try:
            for item, callback in zip(items, callbacks, strict=True):
                rid = rids[len(placed)] if rids else None
                earlier = None if rid is None else self._earlier(rid)
                if earlier is not None and earlier.refs is not None:  # placed already
                    refs, inline = replace_inputs(earlier.refs, item.inputs, payload, inline)
                    pending = Pending(callback, earlier.arena_offsets, item.keep, item.lend,
                                      earlier.stream, refs)  # fmt: skip
                    offsets: list[int] = []
                    if earlier.stream is None and rid is not None:
                        reused.append(rid)
                else:
                    refs, inline, offsets = place_inputs(
                        self.input_arena, item.inputs, item.input_spans, payload, inline
                    )
                    pending = Pending(callback, offsets, item.keep, item.lend, None, refs, notices)
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
        polling.spinner.hold(self._pending)
        release = self._release
        if release:
            self._release = []
        channel.send(infer_message(placed, release), payload)
        return sent

    def _earlier(self, rid: int) -> Pending | None:
        """A rescheduled request's placement: kept since its InferDone, or (decoupled) its
        pending entry, which lives until its final response."""
        return self._kept.pop(rid, None) or self._pending.get(rid)

    def forget(self, rid: int) -> None:
        """A rescheduled request will not run again: its inputs' arena space goes back."""
        pending = self._kept.pop(rid, None) or self._pending.pop(rid, None)
        if pending is not None:
            for offset in pending.arena_offsets:
                self.input_arena.free(offset)

    def cancel(self, rid: int) -> None:
        """The client of request ``rid`` has gone: the model sees ``is_cancelled()``, and
        a request that has not started is not run."""
        if self._channel is not None and rid in self._pending:
            self._channel.send(m.Cancel(rid))

    # -- output-arena space going back ----------------------------------------------------
    def release_outputs(self, offsets: list[int]) -> None:
        """Outputs a reply held in place (``WorkerReply.held``) are read: the worker may
        reuse their space."""
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

    # -- stop ---------------------------------------------------------------------------
    async def stop(self, timeout: float) -> None:
        """Ask the worker to finalize and exit; kill it past the deadline."""
        if self._channel is not None:
            try:
                await self._control_call(m.Shutdown(), timeout, "finalize")
            except errors.DlserveError:
                pass
        await self._launcher.terminate(timeout)
        self.release_resources()

    def release_resources(self) -> None:
        """The worker is gone (or never started): its descriptor socket, its arenas and
        what it lent or borrowed go."""
        _HANDLES.discard(self)
        if self._fd_socket is not None:
            self._fd_socket.close()
            self._fd_socket = None
        self._lending.stop()
        self.input_segment.close()
        self.output_segment.close()
