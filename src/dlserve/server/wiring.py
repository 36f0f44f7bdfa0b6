"""Wires the service, the frontends and the workers together; startup and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlserve.errors import FatalError
from dlserve.server.core.cache.cache_config import CacheSettings
from dlserve.server.core.host.idle_trim import IdleTrim
from dlserve.server.core.host.mps import MpsDaemon
from dlserve.server.core.models.manager import REPLY_POLL_US, REQUEST_POLL_US, ManagerOptions
from dlserve.server.core.models.repository import Repository
from dlserve.server.core.service import InferenceService, ServiceOptions
from dlserve.server.core.shm.owners import OwnerOptions
from dlserve.server.core.shm.registry import AllowClientShm
from dlserve.server.frontends.grpc.convert import MAX_FIELDS
from dlserve.server.frontends.grpc.servicer import create_grpc_server
from dlserve.server.frontends.http.app import create_http_app
from dlserve.server.frontends.http.metrics_endpoint import create_metrics_app
from dlserve.server.frontends.restrictions import Restrictions
from dlserve.server.transport.grpc.limits import DEFAULT_LIMITS, GrpcLimits
from dlserve.server.transport.grpc.listener import TlsOptions
from dlserve.server.transport.h2.limits import Limits
from dlserve.server.transport.http1.limits import Http1Limits
from dlserve.server.transport.http1.listener import HttpServer
from dlserve.server.transport.listen_error import ListenError
from dlserve.tensors import heap
from dlserve.types import ModelState

log = logging.getLogger("dlserve")


@dataclass(slots=True)
class ServerOptions:
    model_repository: Path
    host: str = "127.0.0.1"  # every endpoint's address, unless one of the three below says
    grpc_host: str | None = None  # --grpc-address
    http_host: str | None = None  # --http-address
    metrics_host: str | None = None  # --metrics-address (default: the HTTP endpoint's)
    server_id: str = "dlserve"  # --id: the name in the server's metadata
    model_config_name: str = ""  # --model-config-name: configs/NAME.pbtxt where a model has it
    exit_on_error: bool = True  # --exit-on-error: a model that fails to load stops the server
    log_format: str = "default"  # --log-format
    cpu_metrics: bool = True  # --allow-cpu-metrics
    gpu_metrics: bool = True  # --allow-gpu-metrics
    grpc_port: int = 8001
    http_port: int = 8000
    metrics_port: int = 8002
    model_control_mode: str = "none"
    repository_poll_secs: float = 15.0  # poll mode
    strict_readiness: bool = True  # --strict-readiness
    auto_complete: bool = True  # call the models' auto_complete_config
    allow_grpc: bool = True  # --allow-grpc, --allow-http, --allow-metrics
    allow_http: bool = True
    allow_metrics: bool = True
    load_models: list[str] = field(default_factory=list)
    http_max_input_size: int = 64 * 1024 * 1024
    in_process_workers: bool = False
    ready_fd: int | None = None
    shutdown_timeout: float = 30.0
    allow_client_shm: AllowClientShm = "local"  # who may register shared memory
    busy_poll_us: int = 0  # poll instead of sleeping between requests (workers and server)
    reply_poll_us: int = REPLY_POLL_US  # the server polls this long for a worker's reply
    request_poll_us: int = REQUEST_POLL_US  # a worker polls this long for its next request
    grpc_uds: str | None = None  # gRPC also listens on this Unix socket path
    shm_idle_timeout: float | None = None  # unregister regions unused for this long
    mps: bool = False  # start a private NVIDIA MPS daemon for the workers
    bls_direct: bool = (
        True  # BLS calls may go from worker to worker (server/core/calls/direct_broker.py)
    )
    log_verbose: int = 0  # --log-verbose
    log_levels: tuple[bool, bool, bool] = (True, True, True)  # --log-info/warning/error
    log_file: str = ""  # --log-file
    grpc_tls: TlsOptions | None = None  # --grpc-use-ssl and its files
    trace: dict[str, list[str]] = field(default_factory=dict)  # --trace-config
    cache: CacheSettings | None = None  # --cache-config: the response cache
    grpc_restrictions: Restrictions = field(default_factory=dict)  # --grpc-restricted-protocol
    grpc_limits: GrpcLimits = DEFAULT_LIMITS  # --grpc-max-message-size and the rest of its group
    grpc_infer_max_fields: int = MAX_FIELDS  # of a ModelInferRequest
    http_restrictions: Restrictions = field(default_factory=dict)  # --http-restricted-api
    http_limits: Http1Limits = field(default_factory=Http1Limits)  # --http-max-connections...
    grpc_max_connections: int | None = 4096  # --grpc-max-connections
    grpc_http2: Limits = field(default_factory=Limits)  # gRPC's HTTP/2 limits and keepalive


_ANSWER_GRACE_S = 1.0
"""After the exit timeout, how long the frontends have to send the errors of the requests
the unload ended before they close their connections."""


class Server:
    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        service_options = ServiceOptions(
            model_control_mode=options.model_control_mode,
            repository_poll_secs=options.repository_poll_secs,
            strict_readiness=options.strict_readiness,
            startup_models=list(options.load_models),
            manager=ManagerOptions(
                in_process=options.in_process_workers,
                busy_poll_us=options.busy_poll_us,
                reply_poll_us=options.reply_poll_us,
                request_poll_us=options.request_poll_us,
                stop_timeout=options.shutdown_timeout,
                auto_complete=options.auto_complete,
            ),
            allow_client_shm=options.allow_client_shm,
            log_verbose=options.log_verbose,
            log_levels=options.log_levels,
            log_file=options.log_file,
            owners=OwnerOptions(idle_timeout=options.shm_idle_timeout),
            trace=options.trace,
            cache=options.cache,
            server_id=options.server_id,
            log_format=options.log_format,
            cpu_metrics=options.cpu_metrics,
            gpu_metrics=options.gpu_metrics,
            bls_direct=options.bls_direct,
        )
        repository = Repository(options.model_repository, options.model_config_name)
        self.service = InferenceService(repository, service_options)
        self.hosts = _hosts(options)
        self._http: HttpServer | None = None
        self._metrics: HttpServer | None = None
        if options.allow_http:
            app = create_http_app(
                self.service, options.http_max_input_size, options.http_restrictions
            )
            self._http = HttpServer(
                app, self.hosts["http"], options.http_port, timing=self.service.trace,
                limits=options.http_limits,
            )  # fmt: skip
        if options.allow_metrics:
            metrics = create_metrics_app(self.service)
            self._metrics = HttpServer(metrics, self.hosts["metrics"], options.metrics_port)
        self._grpc: Any = None
        self._mps: MpsDaemon | None = None
        self.idle_trim = IdleTrim()
        self.ports: dict[str, int] = {}

    async def start(self) -> None:
        """0. MPS, when asked  1. load models (--exit-on-error: stop if one failed)
        2. open gRPC, HTTP, metrics  3. report."""
        if not self.options.model_repository.is_dir():
            raise FatalError(f"model repository {self.options.model_repository} is not a directory")
        if self.options.grpc_tls is not None:
            with _fatal_if_cannot_listen():  # unreadable files fail before any model loads
                self.options.grpc_tls.context()
        if self.options.mps:  # before any CUDA context: workers inherit the environment
            # on this (the main) thread: the daemon is told to die with the thread that
            # started it; starting takes milliseconds
            self._mps = MpsDaemon.start()
            os.environ.update(self._mps.env)
        await self.service.startup()
        if self.options.exit_on_error:
            self._stop_if_a_model_failed()
        with _fatal_if_cannot_listen():
            await self._listen()
        self.idle_trim.start()
        self._report()

    async def _listen(self) -> None:
        """Open gRPC, HTTP and metrics, each on its port."""
        if self.options.allow_grpc:
            self._grpc = create_grpc_server(
                self.service, self.hosts["grpc"], self.options.grpc_port, self.options.grpc_uds,
                self.options.grpc_tls, self.options.grpc_restrictions, self.options.grpc_limits,
                self.options.grpc_infer_max_fields, self.options.grpc_http2,
            )  # fmt: skip
            self._grpc.max_connections = self.options.grpc_max_connections
            self.ports["grpc_port"] = await self._grpc.start()
        if self._http is not None:
            self.ports["http_port"] = await self._http.start()
        if self._metrics is not None:
            self.ports["metrics_port"] = await self._metrics.start()

    def _stop_if_a_model_failed(self) -> None:
        failed = [
            f"{entry.name}: {entry.reason}" for entry in self.service.repository_api.index()
            if entry.state is ModelState.UNAVAILABLE
        ]  # fmt: skip
        if failed:
            raise FatalError("failed to load all models (--exit-on-error): " + "; ".join(failed))

    def _report(self) -> None:
        rows = [
            (e.name, e.version or "-", e.state.value if e.state else "UNLOADED", e.reason)
            for e in self.service.repository_api.index()
        ]
        print(_table(("Model", "Version", "Status"), rows), flush=True)
        hosts, ports = self.hosts, self.ports
        if "grpc_port" in ports:
            print(
                f"Started GRPCInferenceService at {hosts['grpc']}:{ports['grpc_port']}", flush=True
            )
            if self.options.grpc_uds:
                print(f"Started GRPCInferenceService at unix:{self.options.grpc_uds}", flush=True)
        if "http_port" in ports:
            print(f"Started HTTPService at {hosts['http']}:{ports['http_port']}", flush=True)
        if "metrics_port" in ports:
            print(
                f"Started Metrics Service at {hosts['metrics']}:{ports['metrics_port']}", flush=True
            )
        if self.options.ready_fd is not None:
            os.write(self.options.ready_fd, json.dumps(self.ports).encode() + b"\n")
            os.close(self.options.ready_fd)

    async def shutdown(self) -> None:
        """Within one exit timeout: the listeners stop accepting at once and the requests
        in flight finish; those still running at the timeout end with the unload's error,
        which the frontends get a short grace to send before they close what is left."""
        timeout = self.options.shutdown_timeout
        await self.idle_trim.stop()
        log.info("shutting down: waiting up to %g s for in-flight requests", timeout)
        frontends = [f for f in (self._grpc, self._http, self._metrics) if f is not None]
        stops = asyncio.gather(*(f.stop(timeout + _ANSWER_GRACE_S) for f in frontends))
        try:
            await self.service.shutdown()
        finally:
            await stops
        if self._mps is not None:
            await asyncio.to_thread(self._mps.stop)
            self._mps = None
        log.info("dlserve stopped")


@contextlib.contextmanager
def _fatal_if_cannot_listen() -> Iterator[None]:
    """A listener that cannot start (the transports' ListenError) stops the server."""
    try:
        yield
    except ListenError as exc:
        raise FatalError(str(exc)) from None


def _hosts(options: ServerOptions) -> dict[str, str]:
    """Each endpoint's address: its own option, else --host; metrics follow HTTP's, as in
    Triton."""
    http = options.http_host or options.host
    return {
        "grpc": options.grpc_host or options.host,
        "http": http,
        "metrics": options.metrics_host or http,
    }


def _table(header: tuple[str, str, str], rows: list[tuple[str, str, str, str]]) -> str:
    cells = [header] + [(n, v, s if not r else f"{s}: {r}") for n, v, s, r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(3)]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [line]
    for index, row in enumerate(cells):
        out.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if index == 0:
            out.append(line)
    out.append(line)
    return "\n".join(out)


async def serve(options: ServerOptions) -> None:
    """Run until SIGINT or SIGTERM, then shut down gracefully."""
    server = Server(options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await server.start()
        _freeze_what_start_made()
        await stop.wait()
    finally:
        await server.shutdown()


def _freeze_what_start_made() -> None:
    """The objects the start made (modules, the models' configs and handles) live as long
    as the server: collected once, then kept out of the cyclic collector's walks. A full
    collection walks every object the process holds, on the event loop: on a host of 16
    vCPUs one took 24 ms while connections came and went, every client waiting."""
    gc.collect()
    gc.freeze()


def run(options: ServerOptions) -> int:
    heap.keep_large_buffers()
    heap.one_heap()  # what the idle trim gives back includes the executor threads' buffers
    heap.no_huge_pages()  # the loop touches arriving messages' fresh pages
    try:
        asyncio_run(serve(options))
    except FatalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def asyncio_run(main: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop where it is installed, unless DLSERVE_LOOP=asyncio asks for the
    standard loop (the tests run the frontends on both)."""
    if os.environ.get("DLSERVE_LOOP") != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            uvloop.run(main)
            return
    asyncio.run(main)
