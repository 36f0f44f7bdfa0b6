"""The server's handle on one worker: start it, send it requests, notice its death.

:class:`SubprocessWorker` runs the worker as ``python -m dlserve.workers.main``
over a socketpair; :class:`InProcessWorker` runs the very same loop in a
thread (tests, ``--debug``). Both speak the same frames.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

from dlserve import errors
from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.ipc.channel import AsyncChannel, BlockingChannel, ChannelClosed
from dlserve.tensors.shm import Arena, ShmSegment
from dlserve.types import InputTensor, OutputTensor, RegionSpan

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
class _Pending:
    future: asyncio.Future[tuple[m.InferDone, memoryview]]
    arena_offsets: list[int]


_NO_SPANS: Final[Mapping[str, RegionSpan]] = {}


def _region_ref(
    name: str, datatype: str, span: RegionSpan, shape: list[int] | None = None
) -> m.TensorRef:
    """A tensor in (or an output going to) a client region; ``nbytes`` is the span's size."""
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
LOOP_SPIN = os.environ.get("DLSERVE_LOOP_SPIN", "") == "1"


class _Spinner:
    """While workers have requests in flight, keep the event loop polling (a callback
    that reschedules itself makes the loop poll its selector without sleeping), so a
    reply is read as soon as it arrives instead of after the loop thread wakes up."""

    def __init__(self) -> None:
        self._waiting: list[dict[int, _Pending]] = []
        self._running = False

    def hold(self, pending: dict[int, _Pending]) -> None:
        if pending not in self._waiting:
            self._waiting.append(pending)
        if not self._running:
            self._running = True
            asyncio.get_running_loop().call_soon(self._spin)

    def _spin(self) -> None:
        self._waiting = [p for p in self._waiting if p]
        if self._waiting:
            asyncio.get_running_loop().call_soon(self._spin)
        else:
            self._running = False


_spinner = _Spinner()
MetricSink = Callable[[MetricMessage], m._Msg | None]


class WorkerBase:
    """Shared logic of both worker kinds; subclasses only start and stop the other side."""

    def __init__(self, label: str) -> None:
        self.label = label
        base_name = f"dlserve_{os.getpid()}_{next(_worker_ids)}"
        # memfds, handed to the worker at spawn; no name exists to be left behind
        self.input_segment = ShmSegment.anonymous(f"{base_name}_in", INPUT_ARENA_SIZE)
        self.output_segment = ShmSegment.anonymous(f"{base_name}_out", OUTPUT_ARENA_SIZE)
        self.input_arena = Arena(self.input_segment)
        self._channel: AsyncChannel[m.WorkerToServer] | None = None
        self._pending: dict[int, _Pending] = {}
        self._rids = itertools.count(1)
        self._control: asyncio.Future[m.WorkerToServer] | None = None
        self._release: list[int] = []
        self._release_scheduled = False
        self.closed: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.on_metric: MetricSink | None = None

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
                if not pending.future.done():
                    pending.future.set_result((msg, payload))
        elif isinstance(msg, m.MetricFamilyDef | m.MetricOp | m.MetricValueCall):
            self._on_metric_message(msg)
        elif self._control is not None and not self._control.done():
            self._control.set_result(msg)

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
            if not pending.future.done():
                pending.future.set_exception(failure)
        self._pending.clear()
        if self._control is not None and not self._control.done():
            self._control.set_exception(failure)
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
        input_spans: Mapping[str, RegionSpan] = _NO_SPANS,
        output_spans: Mapping[str, RegionSpan] = _NO_SPANS,
    ) -> WorkerReply:
        """Run one request. Inputs without data are in client regions (``input_spans``,
        by name); outputs named in ``output_spans`` are written into client regions."""
        channel = self._channel
        if channel is None:
            raise errors.WorkerDiedError(self.death_reason())
        rid = next(self._rids)
        refs, payload, offsets = self._place_inputs(inputs, input_spans)
        future: asyncio.Future[tuple[m.InferDone, memoryview]]
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = _Pending(future, offsets)
        if LOOP_SPIN:
            _spinner.hold(self._pending)
        release, self._release = self._release, []
        msg = m.Infer(rid, request_id, refs, outputs, parameters, release)
        if output_spans:
            msg.output_regions = [_region_ref(n, "", s) for n, s in output_spans.items()]
        channel.send(msg, payload)
        done, payload_back = await future
        return self._reply(done, payload_back)

    def unmap_regions(self, regions: list[int]) -> None:
        """These client regions are gone: the worker drops its mappings of them."""
        if self._channel is not None:
            self._channel.send(m.UnmapRegions(regions))

    def _place_inputs(
        self, inputs: list[InputTensor], spans: Mapping[str, RegionSpan]
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

    def _reply(self, done: m.InferDone, payload: memoryview) -> WorkerReply:
        if done.error_code:
            raise errors.ModelError(done.error, errors.ErrorCode(done.error_code))
        outputs = []
        for ref in done.outputs:
            data: bytes | memoryview | None
            if ref.where == m.Where.PAYLOAD:
                data = payload[ref.offset : ref.offset + ref.nbytes]
            elif ref.where == m.Where.OUTPUT_ARENA:
                data = bytes(self.output_segment.buffer[ref.offset : ref.offset + ref.nbytes])
                self._schedule_release(ref.offset)
            else:
                data = None
            outputs.append(OutputTensor(ref.name, ref.datatype, tuple(ref.shape), data))
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
        self.input_segment.close()
        self.output_segment.close()


class SubprocessWorker(WorkerBase):
    """A worker in its own process."""

    def __init__(self, label: str) -> None:
        super().__init__(label)
        self.process: asyncio.subprocess.Process | None = None

    async def spawn(self, env: dict[str, str] | None = None) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        in_fd, out_fd = self.input_segment.fd, self.output_segment.fd
        assert in_fd is not None and out_fd is not None
        command = [sys.executable, "-m", "dlserve.workers.main", "--fd", str(theirs.fileno()),
                   "--input-arena-fd", str(in_fd), "--output-arena-fd", str(out_fd)]  # fmt: skip
        try:
            self.process = await asyncio.create_subprocess_exec(
                *command, pass_fds=(theirs.fileno(), in_fd, out_fd), env=env,
                stdin=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
        finally:
            theirs.close()
            self.input_segment.close_fd()
            self.output_segment.close_fd()
        await self._connect(ours)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def death_reason(self) -> str:
        code = None if self.process is None else self.process.returncode
        how = "" if code is None else (f" (signal {-code})" if code < 0 else f" (exit code {code})")
        return f"model instance '{self.label}' exited unexpectedly{how}"

    async def _reaped(self, timeout: float) -> None:
        if self.process is not None:
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except TimeoutError:
                pass

    async def _terminate(self, timeout: float) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        try:
            await asyncio.wait_for(process.wait(), timeout)
        except TimeoutError:
            process.kill()
            await process.wait()


class InProcessWorker(WorkerBase):
    """The worker loop in a thread of the server process (tests, ``--debug``)."""

    def __init__(self, label: str) -> None:
        super().__init__(label)
        self._thread: threading.Thread | None = None

    async def spawn(self, env: dict[str, str] | None = None) -> None:
        from dlserve.workers.main import install_pb_utils, serve

        install_pb_utils()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        channel: BlockingChannel[m.ServerToWorker] = BlockingChannel(theirs, codec.to_worker)
        arenas = (self._share(self.input_segment), self._share(self.output_segment))

        def run() -> None:
            try:
                serve(channel, arenas)
            except ChannelClosed:
                pass
            finally:
                channel.close()

        self._thread = threading.Thread(target=run, name=f"worker-{self.label}", daemon=True)
        self._thread.start()
        await self._connect(ours)

    @staticmethod
    def _share(segment: ShmSegment) -> ShmSegment:
        """The worker thread's own mapping of a segment, as a worker process would have."""
        assert segment.fd is not None
        shared = ShmSegment.from_fd(os.dup(segment.fd), segment.name)
        segment.close_fd()
        return shared

    async def _terminate(self, timeout: float) -> None:
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
