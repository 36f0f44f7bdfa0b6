"""Triton's ``inference.GRPCInferenceService``, answered by the InferenceService.

Every RPC translates its message (``convert``), asks the service, and
translates the answer back; failures become gRPC statuses (``status_codes.status_of``,
which the transport is given and applies).
ModelInfer and ModelStreamInfer take and return the bytes gRPC moves, so
that tensor bytes are never copied by protobuf (see ``convert``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any, Final

import grpc
from tritonclient.grpc import service_pb2 as pb

from dlserve.errors import (
    DecoupledModelError,
    DlserveError,
    InvalidArgumentError,
    UnsupportedError,
)
from dlserve.server.core.service import InferenceService
from dlserve.server.core.telemetry.tracer import Trace
from dlserve.server.frontends.grpc import control, convert, health, shm
from dlserve.server.frontends.grpc.status_codes import error_message, status_of
from dlserve.server.frontends.requests import checked_version, of_inference
from dlserve.server.frontends.restrictions import (
    GRPC_METHOD_GROUPS,
    Restriction,
    Restrictions,
    group_of,
)
from dlserve.server.transport.grpc.calls import Context, Guard, Method, Parts, Refused
from dlserve.server.transport.grpc.limits import DEFAULT_LIMITS, GrpcLimits
from dlserve.server.transport.grpc.listener import GrpcServer, TlsOptions
from dlserve.server.transport.grpc.outbox import Outbox
from dlserve.server.transport.grpc.status import Status
from dlserve.server.transport.h2.limits import Limits
from dlserve.types import InferRequest, Peer

log = logging.getLogger("dlserve.grpc")

SERVICE_NAME: Final = "inference.GRPCInferenceService"
STREAM_WINDOW: Final = 64  # requests of one stream in flight at once
UNAVAILABLE: Final = grpc.StatusCode.UNAVAILABLE.value[0]  # a restricted call refused

EMPTY_FINAL: Final = "triton_enable_empty_final_response"  # a request parameter
GRPC_ERROR_HEADER: Final = "triton_grpc_error"  # "true": an error of inference ends a stream
_INFER_DECOUPLED: Final = "ModelInfer RPC doesn't support models with decoupled transaction policy"


class StreamEnd:
    """How a ModelStreamInfer call ends on an error: Triton's ``triton_grpc_error`` mode.

    With the header ``triton_grpc_error: true`` (``strict``), the first error of inference
    ends the stream with that error's gRPC status, as Triton's stream handler does for an
    error its response callback gets: the responses sent before it go first, the stream's
    other requests are cancelled, later responses are dropped. Requests refused before
    they run (a malformed message, an unknown model, bad inputs, a full queue) are
    answered with ``error_message`` and the stream goes on, as Triton answers a request
    it cannot issue. Without the header every error is such a message.
    """

    __slots__ = ("error", "out", "strict")

    def __init__(self, out: Outbox, strict: bool) -> None:
        self.out = out
        self.strict = strict
        self.error: Exception | None = None

    def ends_with(self, error: Exception) -> bool:
        """Whether ``error`` ends the stream (the first such one is kept for its status)."""
        if not self.strict or not of_inference(error):
            return False
        if self.error is None:
            self.error = error
            self.out.put_nowait(None)  # what was queued before it still goes out
        return True


class GrpcServicer:
    """One method per RPC; each is registered by :func:`method_handlers`."""

    def __init__(self, service: InferenceService, max_fields: int = convert.MAX_FIELDS) -> None:
        self._service = service
        self._max_fields = max_fields  # of a ModelInferRequest (--grpc-infer-max-fields)

    # -- health and metadata ------------------------------------------------------------
    async def server_live(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=self._service.live())

    async def server_ready(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=self._service.ready())

    async def health_check(self, request: Any, context: Any) -> Any:
        """grpc.health.v1.Health/Check: SERVING when the server is ready, as Triton."""
        return health.check_response(self._service.ready())

    async def model_ready(self, request: Any, context: Any) -> Any:
        version = checked_version(request.version)  # a bad one is an error, as in Triton
        return pb.ModelReadyResponse(ready=self._service.model_ready(request.name, version))

    async def server_metadata(self, request: Any, context: Any) -> Any:
        return control.server_metadata_response(self._service.server_metadata())

    async def model_metadata(self, request: Any, context: Any) -> Any:
        metadata = self._service.model_metadata(request.name, checked_version(request.version))
        return control.model_metadata_response(metadata)

    async def model_config(self, request: Any, context: Any) -> Any:
        config = self._service.model_config(request.name, checked_version(request.version))
        return pb.ModelConfigResponse(config=config)

    # -- inference ----------------------------------------------------------------------
    def arriving_request(self) -> convert.ArrivingRequest:
        """A look at a ModelInferRequest arriving in pieces: one that is no such message
        is refused from its first bytes (ModelInfer's call ends; a stream gets the error in
        the stream, as for a whole bad message, and goes on)."""
        return convert.ArrivingRequest(self._max_fields)

    async def model_infer(self, request: memoryview, context: Any) -> Parts:
        parsed = await convert.parse_in_turns(request, self._max_fields)
        parsed.peer = shm.peer_of(context.peer())
        trace = self._trace(parsed, context) if context.opened_ns else None
        try:
            response = await self._service.infer(parsed, trace=trace)
        except DecoupledModelError:
            raise UnsupportedError(_INFER_DECOUPLED) from None
        if trace is not None:
            trace.stamp("INFER_RESPONSE_COMPLETE", time.monotonic_ns())
        return convert.infer_response_parts(response)

    def _trace(self, request: InferRequest, context: Any) -> Trace | None:
        """The call's trace when its model's setting samples it (tracing was on when the
        call opened); the transport stamps the sending and releases it."""
        received = time.monotonic_ns()
        trace = self._service.tracer.sample(request.model_name)
        if trace is not None:
            trace.stamp("GRPC_WAITREAD_START", context.opened_ns)
            trace.stamp("GRPC_WAITREAD_END", received)
            context.trace = trace
        return trace

    async def model_stream_infer(
        self, requests: AsyncIterator[memoryview | Refused], context: Any
    ) -> AsyncIterator[bytes | Parts]:
        """Requests run concurrently (up to STREAM_WINDOW); responses leave as they come,
        as Triton sends them: a decoupled model's responses interleave with the others'.

        A failed request answers with ``error_message`` and the stream goes on; with the
        header ``triton_grpc_error: true`` an error of inference ends the stream with its
        status instead (see :class:`StreamEnd`). A client that cancels the RPC (or goes
        away) cancels its requests: the models see ``is_cancelled()``.
        """
        window = asyncio.Semaphore(STREAM_WINDOW)
        # bounded: a slow reader holds the models' sends back; what waits in it counts as
        # its connection's unsent bytes (the send budget)
        out = Outbox(holding=context.holding)
        tasks: set[asyncio.Task[None]] = set()
        peer = shm.peer_of(context.peer())
        end = StreamEnd(out, (GRPC_ERROR_HEADER, "true") in context.invocation_metadata())
        reader = asyncio.create_task(self._read_stream(requests, window, end, tasks, peer, context))
        try:
            while (response := await out.get()) is not None:
                yield response
            if end.error is not None:
                raise end.error  # its status ends the RPC; the finally cancels the rest
            await reader  # a broken request stream ends the RPC with its error
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def _read_stream(
        self, requests: AsyncIterator[memoryview | Refused], window: asyncio.Semaphore,
        end: StreamEnd, tasks: set[asyncio.Task[None]], peer: Peer, context: Context,
    ) -> None:  # fmt: skip
        """Each request starts as one of its connection's calls (``context.may_start``: the
        connection's send budget) and once the outbox can take its response. ``waited``:
        while tracing is on, when the stream began waiting for its next request
        (GRPC_WAITREAD_START of that request's trace)."""
        waited = context.opened_ns
        timing = self._service.trace
        if not waited and timing.active:  # turned on since the stream opened
            waited = time.monotonic_ns()
        try:
            async for data in requests:
                await window.acquire()
                if end.out.crowded(len(tasks)):  # large responses: fewer at once
                    await end.out.admit(tasks.__len__)
                if not context.may_start():
                    await context.wait_to_start()
                context.started()
                one = self._stream_one(data, peer, end, window, waited, context)
                task = asyncio.create_task(one)
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                waited = time.monotonic_ns() if timing.active else 0
            while tasks:  # the client is done sending: finish what it sent
                await asyncio.wait(list(tasks))
        finally:
            end.out.put_nowait(None)

    async def _stream_one(
        self, data: memoryview | Refused, peer: Peer, end: StreamEnd,
        window: asyncio.Semaphore, waited: int, context: Context,
    ) -> None:  # fmt: skip
        request: InferRequest | None = None
        trace: Trace | None = None
        out = end.out
        try:
            if isinstance(data, Refused):  # refused as it arrived (arriving_request)
                raise data.error
            request = await convert.parse_in_turns(data, self._max_fields)
            request.peer = peer
            if waited:
                trace = self._stream_trace(request, waited)
            empty_final = bool(request.parameters.pop(EMPTY_FINAL, False))
            items = self._service.infer_stream(request, trace=trace)
            async with contextlib.aclosing(items):
                async for item in items:
                    if item.error is not None and end.ends_with(item.error):
                        return
                    message = convert.stream_item(request, item, empty_final)
                    if message is None:
                        continue
                    if trace is None:
                        await out.put(message)
                        continue
                    trace.stamp("INFER_RESPONSE_COMPLETE", time.monotonic_ns())
                    trace.stamp("GRPC_SEND_START", time.monotonic_ns())
                    await out.put(message)
                    trace.stamp("GRPC_SEND_END", time.monotonic_ns())
        except Exception as exc:
            if not isinstance(exc, DlserveError):
                log.exception("gRPC ModelStreamInfer request failed")
            if end.ends_with(exc):
                return
            if request is not None:
                request_id = request.id
            else:  # a message the walk refuses has no id to read (nor has it whole)
                request_id = "" if isinstance(data, Refused) else convert.request_id_of(data)
            out.put_nowait(convert.serialize_stream_error(error_message(exc), request_id))
        finally:
            window.release()
            out.finished()
            context.ended()
            if trace is not None:
                trace.release()

    def _stream_trace(self, request: InferRequest, waited: int) -> Trace | None:
        """A stream request's trace, when its model's setting samples it."""
        trace = self._service.tracer.sample(request.model_name)
        if trace is not None:
            trace.stamp("GRPC_WAITREAD_START", waited)
            trace.stamp("GRPC_WAITREAD_END", time.monotonic_ns())
        return trace

    # -- statistics and repository ------------------------------------------------------
    async def model_statistics(self, request: Any, context: Any) -> Any:
        stats = self._service.statistics(request.name, checked_version(request.version))
        return control.statistics_response(stats)

    async def repository_index(self, request: Any, context: Any) -> Any:
        if request.repository_name:
            raise UnsupportedError("'repository_name' specification is not supported")
        entries = self._service.repository_api.index(ready_only=request.ready)
        return control.repository_index_response(entries)

    async def repository_model_load(self, request: Any, context: Any) -> Any:
        config_json, files = control.load_parameters(request)
        await self._service.repository_api.load(request.model_name, config_json, files or None)
        return pb.RepositoryModelLoadResponse()

    async def repository_model_unload(self, request: Any, context: Any) -> Any:
        control.check_unload_request(request)
        await self._service.repository_api.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # -- shared memory ------------------------------------------------------------------
    async def system_shm_status(self, request: Any, context: Any) -> Any:
        return shm.status_response(self._service.shared_memory.status(request.name))

    async def system_shm_register(self, request: Any, context: Any) -> Any:
        peer = _register_peer(context)
        await self._service.shared_memory.register(
            request.name, request.key, request.offset, request.byte_size, peer
        )
        return pb.SystemSharedMemoryRegisterResponse()

    async def system_shm_unregister(self, request: Any, context: Any) -> Any:
        self._service.shared_memory.unregister(request.name, shm.peer_of(context.peer()))
        return pb.SystemSharedMemoryUnregisterResponse()

    async def cuda_shm_status(self, request: Any, context: Any) -> Any:
        return shm.cuda_status_response(self._service.shared_memory.status(request.name, cuda=True))

    async def cuda_shm_register(self, request: Any, context: Any) -> Any:
        peer = _register_peer(context)
        await self._service.shared_memory.register_cuda(
            request.name, request.raw_handle, request.device_id, request.byte_size, peer
        )
        return pb.CudaSharedMemoryRegisterResponse()

    async def cuda_shm_unregister(self, request: Any, context: Any) -> Any:
        self._service.shared_memory.unregister(request.name, shm.peer_of(context.peer()), cuda=True)
        return pb.CudaSharedMemoryUnregisterResponse()

    # -- trace and log settings ---------------------------------------------------------
    async def trace_setting(self, request: Any, context: Any) -> Any:
        model = request.model_name
        if model and not self._service.model_ready(model):
            raise InvalidArgumentError(f"Request for unknown model : {model}")
        if request.settings:
            self._service.trace.update(model, control.trace_settings_update(request))
        return control.trace_settings_response(self._service.trace.get(model))

    async def log_settings(self, request: Any, context: Any) -> Any:
        if request.settings:
            self._service.update_log_settings(control.log_settings_update(request))
        return control.log_settings_response(self._service.log_settings)


def _register_peer(context: Context) -> Peer:
    """Who registers a region: the connection's peer, its claimed and its confirmed pid."""
    claimed = shm.claimed_pid(context.invocation_metadata())
    return shm.peer_of(context.peer(), claimed, context.peer_pid())


def _unary(method: Any, request_type: Any, response_type: Any) -> Method:
    return Method(method, deserialize=request_type.FromString,
                  serialize=response_type.SerializeToString)  # fmt: skip


def method_handlers(s: GrpcServicer) -> dict[str, Method]:
    """The service's method table by path; the two infer RPCs pass bytes through unparsed."""
    table = {
        "ServerLive": _unary(s.server_live, pb.ServerLiveRequest, pb.ServerLiveResponse),
        "ServerReady": _unary(s.server_ready, pb.ServerReadyRequest, pb.ServerReadyResponse),
        "ModelReady": _unary(s.model_ready, pb.ModelReadyRequest, pb.ModelReadyResponse),
        "ServerMetadata": _unary(s.server_metadata, pb.ServerMetadataRequest,
                                 pb.ServerMetadataResponse),
        "ModelMetadata": _unary(s.model_metadata, pb.ModelMetadataRequest,
                                pb.ModelMetadataResponse),
        "ModelInfer": Method(s.model_infer, screen=s.arriving_request),
        "ModelStreamInfer": Method(s.model_stream_infer, streaming=True,
                                   screen=s.arriving_request),
        "ModelConfig": _unary(s.model_config, pb.ModelConfigRequest, pb.ModelConfigResponse),
        "ModelStatistics": _unary(s.model_statistics, pb.ModelStatisticsRequest,
                                  pb.ModelStatisticsResponse),
        "RepositoryIndex": _unary(s.repository_index, pb.RepositoryIndexRequest,
                                  pb.RepositoryIndexResponse),
        "RepositoryModelLoad": _unary(s.repository_model_load, pb.RepositoryModelLoadRequest,
                                      pb.RepositoryModelLoadResponse),
        "RepositoryModelUnload": _unary(s.repository_model_unload,
                                        pb.RepositoryModelUnloadRequest,
                                        pb.RepositoryModelUnloadResponse),
        "SystemSharedMemoryStatus": _unary(s.system_shm_status,
                                           pb.SystemSharedMemoryStatusRequest,
                                           pb.SystemSharedMemoryStatusResponse),
        "SystemSharedMemoryRegister": _unary(s.system_shm_register,
                                             pb.SystemSharedMemoryRegisterRequest,
                                             pb.SystemSharedMemoryRegisterResponse),
        "SystemSharedMemoryUnregister": _unary(s.system_shm_unregister,
                                               pb.SystemSharedMemoryUnregisterRequest,
                                               pb.SystemSharedMemoryUnregisterResponse),
        "CudaSharedMemoryStatus": _unary(s.cuda_shm_status, pb.CudaSharedMemoryStatusRequest,
                                         pb.CudaSharedMemoryStatusResponse),
        "CudaSharedMemoryRegister": _unary(s.cuda_shm_register,
                                           pb.CudaSharedMemoryRegisterRequest,
                                           pb.CudaSharedMemoryRegisterResponse),
        "CudaSharedMemoryUnregister": _unary(s.cuda_shm_unregister,
                                             pb.CudaSharedMemoryUnregisterRequest,
                                             pb.CudaSharedMemoryUnregisterResponse),
        "TraceSetting": _unary(s.trace_setting, pb.TraceSettingRequest, pb.TraceSettingResponse),
        "LogSettings": _unary(s.log_settings, pb.LogSettingsRequest, pb.LogSettingsResponse),
    }  # fmt: skip
    methods = {f"/{SERVICE_NAME}/{name}": method for name, method in table.items()}
    methods[f"/{health.SERVICE}/Check"] = _unary(
        s.health_check, health.HealthCheckRequest, health.HealthCheckResponse
    )
    return methods


def restrict(methods: dict[str, Method], restrictions: Restrictions) -> dict[str, Method]:
    """``methods`` with each restricted group's header check as their guard."""
    out = {}
    for path, method in methods.items():
        restriction = restrictions.get(group_of(GRPC_METHOD_GROUPS, path))
        out[path] = method if restriction is None else replace(method, guard=_guard(restriction))
    return out


def _guard(restriction: Restriction) -> Guard:
    """A call without the group's header ends UNAVAILABLE with Triton's message."""
    refusal: Status = (UNAVAILABLE, restriction.grpc_message)

    def guard(headers: list[tuple[str, str]]) -> Status | None:
        return None if restriction.allows(headers) else refusal

    return guard


def create_grpc_server(
    service: InferenceService, host: str, port: int, uds_path: str | None = None,
    tls: TlsOptions | None = None, restrictions: Restrictions | None = None,
    limits: GrpcLimits = DEFAULT_LIMITS, max_fields: int = convert.MAX_FIELDS,
    http2: Limits | None = None,
) -> GrpcServer:  # fmt: skip
    """An unstarted gRPC server for ``service`` on ``host:port`` (0: a free port), over TLS
    with ``tls``; with ``uds_path``, also on that Unix socket (a stale socket file is
    replaced); ``restrictions``: groups of methods that only calls with a header may use;
    ``limits``: what one peer may make the server hold; ``max_fields``: of a
    ModelInferRequest; ``http2``: each HTTP/2 connection's limits and keepalive."""
    methods = restrict(method_handlers(GrpcServicer(service, max_fields)), restrictions or {})
    return GrpcServer(
        methods, host, port, uds_path, tls, timing=service.trace, status_of=status_of,
        limits=limits, http2=http2 or Limits(),
    )  # fmt: skip
