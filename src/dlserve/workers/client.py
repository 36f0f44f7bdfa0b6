"""The server's handle on one worker: start it, send it requests, notice its death.

:class:`WorkerBase` speaks the frames: requests out (``infer``, ``infer_stream`` for a
decoupled model), replies and a worker's own calls (metrics, BLS) in. The two kinds of
worker (a process, or a thread for tests and ``--debug``) are in ``processes.py``; the
memory workers lend each other for BLS in ``lending.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol

from dlserve import errors
from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.ipc.channel import AsyncChannel
from dlserve.tensors.shm import Arena, ShmSegment
from dlserve.types import ArenaSpan, CudaSpan, InputTensor, OutputTensor, RegionSpan
from dlserve.workers.lending import ArenaLending

INLINE_INPUT_LIMIT: Final = 64 * 1024
INPUT_ARENA_SIZE: Final = 256 * 1024 * 1024
OUTPUT_ARENA_SIZE: Final = 256 * 1024 * 1024
REAP_TIMEOUT_S: Final = 1.0  # how long a dead worker's exit status is waited for
_worker_ids = itertools.count()


@dataclass(slots=True)
class WorkerReply:
    outputs: list[OutputTensor]
    timings: m.Timings | None
    parameters: dict[str, m.ParamValue] = field(default_factory=dict)


@dataclass(slots=True)
class StreamReply:
    """One response of a decoupled request: a reply or an error; ``final`` ends it."""

    reply: WorkerReply | None
    error: errors.DlserveError | None
    final: bool
    timings: m.Timings | None = None  # with the final one


StreamItem = tuple[m.StreamResponse, memoryview] | errors.DlserveError


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[tuple[m.InferDone, memoryview]] | None
    arena_offsets: list[int]
    stream: asyncio.Queue[StreamItem] | None = None  # a decoupled request's responses
    abandoned: bool = False  # its consumer is gone: responses are dropped as they come


class CallSink(Protocol):
    """Where a worker's BLS and model-control calls go (the core)."""

    def on_bls(self, caller: WorkerBase, msg: m.BlsCall, payload: memoryview) -> None: ...

    def on_control(self, caller: WorkerBase, msg: m.ControlCall) -> None: ...


Span = RegionSpan | ArenaSpan | CudaSpan
_NO_SPANS: Final[Mapping[str, Span]] = {}


def _region_ref(
    name: str, datatype: str, span: Span, shape: list[int] | None = None
) -> m.TensorRef:
    """A tensor in (or an output going to) a client region (system or CUDA), or in another
    worker's memory (a BLS caller's); ``nbytes`` is the span's size."""
    if isinstance(span, CudaSpan):
        return m.TensorRef(
            name, datatype, shape or [], m.Where.CUDA_IPC, span.offset, span.byte_size,
            handle=span.handle, device=span.device,
        )  # fmt: skip
    if isinstance(span, ArenaSpan):
        return m.TensorRef(
            name, datatype, shape or [], m.Where.PEER_ARENA, span.offset, span.byte_size,
            span.arena_id, span.path,
        )  # fmt: skip
    if span.is_cuda:
        return m.TensorRef(
            name, datatype, shape or [], m.Where.CUDA_REGION, span.offset, span.byte_size,
            span.region_id, handle=span.handle, device=span.device,
        )  # fmt: skip
    return m.TensorRef(
        name, datatype, shape or [], m.Where.CLIENT_REGION, span.offset, span.byte_size,
        span.region_id, span.key,
    )  # fmt: skip


MetricMessage = m.MetricFamilyDef | m.MetricOp | m.MetricValueCall
MetricSink = Callable[[MetricMessage], m._Msg | None]


class WorkerBase(ArenaLending):
    """Shared logic of both worker kinds; subclasses only start and stop the other side."""

    def __init__(self, label: str) -> None:
        self.label = label
        base_name = f"dlserve_{os.getpid()}_{next(_worker_ids)}"
        # memfds, handed to the worker at spawn; no name exists to be left behind
        self.input_segment = ShmSegment.anonymous(f"{base_name}_in", INPUT_ARENA_SIZE)
        self.output_segment = ShmSegment.anonymous(f"{base_name}_out", OUTPUT_ARENA_SIZE)
        self.input_arena = Arena(self.input_segment)
        self._start_lending(self.input_segment, self.output_segment)
        self._channel: AsyncChannel[m.WorkerToServer] | None = None
        self._pending: dict[int, _Pending] = {}
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
    async def _connect(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_unix_connection(
            lambda: AsyncChannel(codec.to_server, self._on_frame, self._on_lost), sock=sock
        )
        self._channel = protocol

    def _on_frame(self, msg: m.WorkerToServer, payload: memoryview) -> None:
        if isinstance(msg, m.InferDone):
            pending = self._pending.pop(msg.rid, None)
            if pending is not None:
                for offset in pending.arena_offsets:
                    self.input_arena.free(offset)
                if pending.future is not None and not pending.future.done():
                    pending.future.set_result((msg, payload))
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
        elif isinstance(msg, m.PeerRelease):
            for arena, offset in zip(msg.arenas, msg.offsets, strict=True):
                self.give_back(arena, offset)
        elif self._control is not None and not self._control.done():
            self._control.set_result(msg)

    def _on_stream_response(self, msg: m.StreamResponse, payload: memoryview) -> None:
        pending = self._pending.get(msg.rid)
        if pending is None or pending.stream is None:
            return
        if msg.final:
            del self._pending[msg.rid]
            for offset in pending.arena_offsets:  # the model may read its inputs until now
                self.input_arena.free(offset)
        if pending.abandoned:
            for ref in msg.outputs:
                if ref.where == m.Where.OUTPUT_ARENA:
                    self._schedule_release(ref.offset)
            return
        pending.stream.put_nowait((msg, payload))

    def send_answer(self, msg: m.BlsReply | m.ControlReply, payload: list[memoryview]) -> None:
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
        for pending in self._pending.values():
            if pending.stream is not None:
                pending.stream.put_nowait(failure)
            elif pending.future is not None and not pending.future.done():
                pending.future.set_exception(failure)
        self._pending.clear()
        if self._control is not None and not self._control.done():
            self._control.set_exception(failure)
        self._give_back_all()  # what it mapped of other workers' outputs
        if not self.closed.done():
            self.closed.set_result(reason)

    def death_reason(self) -> str:
        return f"model instance '{self.label}' exited unexpectedly"

    async def _reaped(self, timeout: float) -> None:
        """Wait (briefly) for the other side to be gone for good."""

    # -- load ---------------------------------------------------------------------------
    async def load(self, msg: m.Load, timeout: float) -> m.Loaded:
        """Send Load and wait for the answer; raises UnavailableError with the reason."""
        self.label = msg.instance_name or self.label  # a reused worker becomes this instance
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
    def inflight(self) -> int:
        return len(self._pending)

    @property
    def alive(self) -> bool:
        return self._channel is not None

    async def infer(
        self,
        request_id: str,
        inputs: list[InputTensor],
        outputs: list[str],
        parameters: dict[str, m.ParamValue],
        input_spans: Mapping[str, Span] = _NO_SPANS,
        output_spans: Mapping[str, Span] = _NO_SPANS,
        chain: list[str] | None = None,
        lend: bool = False,
    ) -> WorkerReply:
        """Run one request. Inputs without data are in client regions (``input_spans``,
        by name); outputs named in ``output_spans`` are written into client regions.
        ``chain``: the models upstream of a BLS request; ``lend``: outputs in the output
        arena stay there for the caller to map (see :meth:`arena_span`)."""
        channel = self._channel
        if channel is None:
            raise errors.WorkerDiedError(self.death_reason())
        rid = next(self._rids)
        refs, payload, offsets = self._place_inputs(inputs, input_spans)
        future: asyncio.Future[tuple[m.InferDone, memoryview]]
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = _Pending(future, offsets)
        release, self._release = self._release, []
        msg = m.Infer(rid, request_id, refs, outputs, parameters, release)
        if output_spans:
            msg.output_regions = [_region_ref(n, "", s) for n, s in output_spans.items()]
        if chain:
            msg.chain = chain
        msg.lend = lend
        channel.send(msg, payload)
        try:
            done, payload_back = await future
        except asyncio.CancelledError:
            self.cancel(rid)
            raise
        return self._reply(done, payload_back, lend)

    async def infer_stream(
        self,
        request_id: str,
        inputs: list[InputTensor],
        outputs: list[str],
        parameters: dict[str, m.ParamValue],
        input_spans: Mapping[str, Span] = _NO_SPANS,
        output_spans: Mapping[str, Span] = _NO_SPANS,
        chain: list[str] | None = None,
        lend: bool = False,
    ) -> AsyncGenerator[StreamReply, None]:
        """Run one request of a decoupled model: its responses as they come, the last one
        final. Leaving early (the client went away) tells the model: ``is_cancelled()``."""
        channel = self._channel
        if channel is None:
            raise errors.WorkerDiedError(self.death_reason())
        rid = next(self._rids)
        refs, payload, offsets = self._place_inputs(inputs, input_spans)
        pending = _Pending(None, offsets, asyncio.Queue())
        self._pending[rid] = pending
        release, self._release = self._release, []
        msg = m.Infer(rid, request_id, refs, outputs, parameters, release, chain=chain or [],
                      lend=lend)  # fmt: skip
        if output_spans:
            msg.output_regions = [_region_ref(n, "", s) for n, s in output_spans.items()]
        channel.send(msg, payload)
        final = False
        try:
            while not final:
                item = await pending.stream.get()  # type: ignore[union-attr]
                if isinstance(item, errors.DlserveError):
                    final = True
                    yield StreamReply(None, item, True)
                    return
                frame, data = item
                final = frame.final
                yield self._stream_reply(frame, data, lend)
        finally:
            if not final:
                pending.abandoned = True
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
        return StreamReply(self._reply(done, payload, lend), None, frame.final, frame.timings)

    def cancel(self, rid: int) -> None:
        """The client of request ``rid`` has gone: the model sees ``is_cancelled()``."""
        if self._channel is not None and rid in self._pending:
            self._channel.send(m.Cancel(rid))

    def unmap_regions(self, regions: list[int]) -> None:
        """These client regions are gone: the worker drops its mappings of them."""
        if self._channel is not None:
            self._channel.send(m.UnmapRegions(regions))

    def _place_inputs(
        self, inputs: list[InputTensor], spans: Mapping[str, Span]
    ) -> tuple[list[m.TensorRef], list[memoryview], list[int]]:
        refs: list[m.TensorRef] = []
        payload: list[memoryview] = []
        offsets: list[int] = []
        inline_offset = 0
        for tensor in inputs:
            data = tensor.data
            if data is None:  # in a client's region: the worker maps it, nothing to copy
                refs.append(_region_ref(tensor.name, tensor.datatype, spans[tensor.name],
                                        list(tensor.shape)))  # fmt: skip
                continue
            nbytes = data.nbytes
            arena_offset = self.input_arena.alloc(nbytes) if nbytes > INLINE_INPUT_LIMIT else None
            if arena_offset is None:  # small, or no arena space: inline in the frame
                where, offset = m.Where.PAYLOAD, inline_offset
                payload.append(data)
                inline_offset += nbytes
            else:  # the one copy, into the shared memory the worker maps
                where, offset = m.Where.INPUT_ARENA, arena_offset
                self.input_arena.view(arena_offset, nbytes)[:] = data.cast("B")
                offsets.append(arena_offset)
            ref = m.TensorRef(
                tensor.name, tensor.datatype, list(tensor.shape), where, offset, nbytes
            )
            refs.append(ref)
        return refs, payload, offsets

    def _reply(self, done: m.InferDone, payload: memoryview, lend: bool = False) -> WorkerReply:
        if done.error_code:
            raise errors.ModelError(done.error, errors.ErrorCode(done.error_code))
        outputs = []
        for ref in done.outputs:
            data: bytes | memoryview | None
            lent: ArenaSpan | CudaSpan | None = None
            if ref.where == m.Where.PAYLOAD:
                data = payload[ref.offset : ref.offset + ref.nbytes]
            elif ref.where == m.Where.OUTPUT_ARENA and lend:  # released by the BLS caller
                data, lent = None, self.arena_span(m.Where.OUTPUT_ARENA, ref.offset, ref.nbytes)
            elif ref.where == m.Where.CUDA_IPC:  # a GPU output lent to a BLS caller
                data = None
                lent = CudaSpan(ref.handle, ref.device, ref.offset, ref.nbytes, ref.lend,
                                self.arena_ids[1])  # fmt: skip
            elif ref.where == m.Where.OUTPUT_ARENA:
                data = bytes(self.output_segment.buffer[ref.offset : ref.offset + ref.nbytes])
                self._schedule_release(ref.offset)
            else:
                data = None
            shape = tuple(ref.shape)
            outputs.append(OutputTensor(ref.name, ref.datatype, shape, data, lent=lent))
        return WorkerReply(outputs, done.timings, done.parameters)

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
        await self._terminate(timeout)
        self._cleanup_shm()

    async def _terminate(self, timeout: float) -> None:
        raise NotImplementedError

    def _cleanup_shm(self) -> None:
        self._stop_lending()
        self.input_segment.close()
        self.output_segment.close()
