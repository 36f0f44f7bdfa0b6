"""The one entry point of the frontends: everything the protocols can ask for."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.registry import Collector

from dlserve import __version__, errors
from dlserve.server.core import classification, streams
from dlserve.server.core.cache.cache_config import CacheSettings
from dlserve.server.core.cache.response_cache import CacheCollector, ResponseCache, cacheable
from dlserve.server.core.calls import ensemble_steps
from dlserve.server.core.calls.bls_router import BlsRouter
from dlserve.server.core.instances.replies import WorkerReply
from dlserve.server.core.models.config import config_to_dict
from dlserve.server.core.models.manager import (
    UNLOADED,
    ManagerOptions,
    ModelEntry,
    ModelManager,
    ModelVersion,
)
from dlserve.server.core.models.poller import RepositoryPoller
from dlserve.server.core.models.repository import Repository
from dlserve.server.core.raw_input import raw_input
from dlserve.server.core.service_api import RepositoryApi, SharedMemoryApi
from dlserve.server.core.shm.owners import OwnerOptions, ReclaimCollector, RegionOwners
from dlserve.server.core.shm.registry import AllowClientShm, RegionRegistry
from dlserve.server.core.streams import NO_CALL, Call, StreamItem, reply_outputs
from dlserve.server.core.telemetry.log_settings import LogSettings
from dlserve.server.core.telemetry.metrics import Metrics
from dlserve.server.core.telemetry.stats import failure_reason
from dlserve.server.core.telemetry.system_metrics import SystemCollector
from dlserve.server.core.telemetry.tracer import Trace, Tracer
from dlserve.types import (
    InferRequest,
    InferResponse,
    InputTensor,
    ModelMetadata,
    ModelState,
    ModelStatistics,
    OutputTensor,
    Parameters,
    ServerMetadata,
    TensorMetadata,
)

log = logging.getLogger("dlserve")


EXTENSIONS = (
    "classification", "sequence", "model_repository", "model_repository(unload_dependents)",
    "schedule_policy", "model_configuration", "system_shared_memory", "cuda_shared_memory",
    "binary_tensor_data", "parameters", "statistics", "logging",
)  # fmt: skip


@dataclass(slots=True)
class ServiceOptions:
    model_control_mode: str = "none"  # "none" | "explicit" | "poll"
    repository_poll_secs: float = 15.0  # poll mode: how often the repository is looked at
    strict_readiness: bool = True  # ready only while every model is (Triton's default)
    startup_models: list[str] = field(default_factory=list)  # explicit mode: --load-model
    manager: ManagerOptions = field(default_factory=ManagerOptions)
    allow_client_shm: AllowClientShm = "local"  # who may register shared memory
    owners: OwnerOptions = field(default_factory=OwnerOptions)  # reclaiming regions
    log_verbose: int = 0  # --log-verbose: the log settings' first verbose level
    log_levels: tuple[bool, bool, bool] = (True, True, True)  # info, warning, error
    log_file: str = ""  # --log-file (the process's stderr already goes there)
    log_format: str = "default"  # --log-format: "default" or "ISO8601"
    trace: dict[str, list[str]] = field(default_factory=dict)  # --trace-config, as the API's
    cache: CacheSettings | None = None  # --cache-config: the response cache
    server_id: str = "dlserve"  # --id: the name in the server's metadata
    cpu_metrics: bool = True  # --allow-cpu-metrics
    gpu_metrics: bool = True  # --allow-gpu-metrics
    bls_direct: bool = True  # --bls-direct: BLS calls may go from worker to worker


class InferenceService(SharedMemoryApi, RepositoryApi):
    def __init__(self, repository: Repository, options: ServiceOptions) -> None:
        self.repository = repository
        self.options = options
        self.model_control_mode = options.model_control_mode
        self.regions = RegionRegistry(options.allow_client_shm)
        self.owners = RegionOwners([self.regions], options.owners)
        settings = options.cache
        self.cache = ResponseCache(settings.size) if settings is not None else None
        system = SystemCollector(options.cpu_metrics, options.gpu_metrics)
        collectors: list[Collector] = [ReclaimCollector(self.owners), system]
        if self.cache is not None:
            collectors.append(CacheCollector(self.cache))
        self.metrics = Metrics(lambda: self.manager.all_stats(), collectors)
        self.bls = BlsRouter(self)
        self.manager = ModelManager(
            repository, options.manager, self.metrics.custom, self.bls, self.cache
        )
        self.manager.on_change = self.bls.direct.changed
        self.bls.direct.enabled = options.bls_direct
        self._log = LogSettings(options.log_verbose, options.log_file)
        if options.log_levels != (True, True, True):  # the server and every worker from now on
            info, warning, error = options.log_levels
            self._log.update({"log_info": info, "log_warning": warning, "log_error": error})
        if options.log_format != "default":
            self._log.update({"log_format": options.log_format})
        self.tracer = Tracer(options.trace)
        self.trace = self.tracer.settings
        self.poller: RepositoryPoller | None = None
        if options.model_control_mode == "poll":
            self.poller = RepositoryPoller(
                repository, options.repository_poll_secs, self.manager.load,
                self.manager.unload, repository.is_ensemble,
            )  # fmt: skip
        self._started = False

    # -- lifecycle ----------------------------------------------------------------------
    async def startup(self) -> None:
        """Load the models the control mode asks for; failures leave models UNAVAILABLE."""
        if self.options.model_control_mode == "explicit":
            names = self.options.startup_models
            if "*" in names:
                names = self.repository.model_names()
        else:
            names = self.repository.model_names()
        self.owners.start()
        if self.poller is not None:
            self.poller.remember(names)  # before loading: a change meanwhile is seen
        ensembles = [n for n in names if self.repository.is_ensemble(n)]
        await asyncio.gather(*(self._load_at_startup(n) for n in names if n not in ensembles))
        for name in ensembles:  # after the models they are made of
            await self._load_at_startup(name)
        if self.poller is not None:
            self.poller.start()
        self._started = True

    async def _load_at_startup(self, name: str) -> None:
        try:
            await self.manager.load(name)
        except errors.DlserveError:
            pass  # the model's entry is UNAVAILABLE with the reason

    async def shutdown(self) -> None:
        self._started = False
        if self.poller is not None:
            await self.poller.stop()
        await self.owners.stop()
        await self.manager.unload_all()
        self.repository.close()
        self.tracer.close()

    # -- health and metadata ------------------------------------------------------------
    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        """Started, and with strict readiness (Triton's default) every model the server
        tried to load is READY with every instance up, or was unloaded."""
        if not self._started:
            return False
        if not self.options.strict_readiness:
            return True
        return all(
            (e.state == ModelState.READY and all(v.ready for v in e.versions.values()))
            or (e.state == ModelState.UNAVAILABLE and e.reason == UNLOADED)
            for e in self.manager.models.values()
        )

    def server_metadata(self) -> ServerMetadata:
        return ServerMetadata(self.options.server_id, __version__, EXTENSIONS)

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            return self.version(name, version).ready
        except errors.DlserveError:
            return False

    def version(self, name: str, version: str = "") -> ModelVersion:
        """The version a request addresses; raises Triton's not-found errors."""
        entry = self.manager.entry(name)
        if entry is None or not entry.versions:
            raise self._unknown(name, version, entry)
        if not version or version == "-1":
            found = entry.latest_ready()
            if found is None:
                raise errors.UnavailableError(
                    f"Request for unknown model: '{name}' has no available versions"
                )
            return found
        try:
            return entry.versions[int(version)]
        except (ValueError, KeyError):
            raise errors.NotFoundError(
                f"Request for unknown model: '{name}' version {version} is not found"
            ) from None

    @staticmethod
    def _unknown(name: str, version: str, entry: ModelEntry | None) -> errors.DlserveError:
        if entry is not None and entry.state == ModelState.UNAVAILABLE:
            return errors.UnavailableError(
                f"Request for unknown model: '{name}' has no available versions"
            )
        if version:
            return errors.NotFoundError(
                f"Request for unknown model: '{name}' version {version} is not found"
            )
        return errors.NotFoundError(f"Request for unknown model: '{name}' is not found")

    def model_metadata(self, name: str, version: str = "") -> ModelMetadata:
        loaded = self.version(name, version)
        entry = self.manager.models[name]
        config = loaded.config
        batch = (-1,) if config.max_batch_size > 0 else ()
        inputs = tuple(
            TensorMetadata(s.name, s.dtype.wire, batch + s.dims)
            for s in loaded.validator.inputs.values()
        )
        outputs = tuple(
            TensorMetadata(s.name, s.dtype.wire, batch + s.dims)
            for s in loaded.validator.outputs.values()
        )
        versions = tuple(str(v) for v in sorted(entry.versions))
        return ModelMetadata(name, versions, config.backend or config.platform, inputs, outputs)

    def model_config(self, name: str, version: str = "") -> Any:
        """The model's ModelConfig message, as normalized and auto-completed."""
        return self.version(name, version).config

    def raw_input(self, name: str, version: str, body: memoryview) -> InputTensor:
        """The one input of a raw binary request (the body is its data), as Triton
        deduces it from the model's config (``server/core/raw_input.py``)."""
        return raw_input(name, self.version(name, version).config, body)

    def model_config_dict(self, name: str, version: str = "") -> dict[str, Any]:
        return config_to_dict(self.model_config(name, version))

    # -- inference ----------------------------------------------------------------------
    async def infer(
        self, request: InferRequest, call: Call = NO_CALL, trace: Trace | None = None
    ) -> InferResponse:
        """Run one request of a model that answers once. When its caller is cancelled (the
        client went away), a request still queued leaves the queue without being executed.
        ``call``: a BLS request's upstream models and the memory its inputs are in.
        ``trace``: the request's trace, when it is traced (the caller releases it)."""
        received = time.monotonic_ns()
        loaded = self.version(request.model_name, request.model_version)
        if trace is not None:
            trace.started(request.model_name, loaded.version, request.id, received)
        if loaded.decoupled:
            raise errors.DecoupledModelError(
                f"model '{request.model_name}' uses the decoupled transaction policy: use "
                "the streaming endpoint"
            )
        classes = classification.requested(request) if request.outputs else {}
        try:
            cache = loaded.cache
            if cache is not None and call is NO_CALL and cacheable(request):
                run = functools.partial(self._outputs, loaded, request, call, received, trace)
                outputs, parameters = await cache.outputs(request, received, run)
            else:
                outputs, parameters = await self._outputs(loaded, request, call, received, trace)
            if classes:
                batched = loaded.config.max_batch_size > 0
                outputs = classification.apply(outputs, classes, batched, loaded.labels)
        except errors.DlserveError as exc:
            loaded.stats.record_failure(time.monotonic_ns() - received, failure_reason(exc))
            raise
        except asyncio.CancelledError:
            loaded.stats.record_failure(time.monotonic_ns() - received, "CANCELED")
            raise
        finally:
            if trace is not None:
                trace.stamp("REQUEST_END", time.monotonic_ns())
        return InferResponse(
            request.model_name, str(loaded.version), request.id, outputs, parameters
        )

    async def _outputs(
        self, loaded: ModelVersion, request: InferRequest, call: Call, received: int,
        trace: Trace | None = None,
    ) -> tuple[list[OutputTensor], Parameters]:  # fmt: skip
        """The model's answer to ``request`` (an ensemble's: its steps'), counted."""
        if loaded.ensemble is not None:
            outputs = await ensemble_steps.run(self, loaded, request, received, trace)
            if trace is not None:
                trace.outputs(outputs)
            return outputs, {}
        reply, batch = await self._run(loaded, request, call=call, trace=trace)
        self._record(loaded, reply, batch, received)
        outputs = reply_outputs(loaded, reply)
        if trace is not None:
            trace.computed(reply, outputs)
        return outputs, dict(reply.parameters) if reply.parameters else {}

    def infer_stream(
        self, request: InferRequest, call: Call = NO_CALL, trace: Trace | None = None
    ) -> AsyncGenerator[StreamItem, None]:
        """Run a request over a stream: one item per response (see ``streams``)."""
        return streams.infer_stream(self, request, call, trace)

    @staticmethod
    def _record(loaded: ModelVersion, reply: WorkerReply, batch: int, received: int) -> None:
        t = reply.timings
        if t is None:
            return
        now = time.monotonic_ns()
        loaded.stats.record_request(
            batch if loaded.validator.max_batch_size > 0 else 1,
            now - received,
            t.input_start - received,
            t.infer_start - t.input_start,
            t.infer_end - t.infer_start,
            now - t.infer_end,
        )

    async def _run(
        self, loaded: ModelVersion, request: InferRequest, *, keep: bool = False,
        call: Call = NO_CALL, trace: Trace | None = None,
    ) -> tuple[WorkerReply, int]:  # fmt: skip
        """Check the request and run it on an instance: the reply, and the batch size.

        The regions it names are checked first (as Triton does) and stay in use until it
        is done, so that unregistering one meanwhile cannot unmap it under the model.
        """
        assert loaded.scheduler is not None
        lease = call.lease if call.lease is not None else self.regions.lease(request)
        try:
            inputs, batch = loaded.validator.check(request)
            outputs = [o.name for o in request.outputs]
            job = loaded.scheduler.job(
                request.id, inputs, outputs, request.parameters, batch, lease, keep=keep,
                chain=list(call.chain), lend=call.lend,
            )  # fmt: skip
            if trace is not None:
                job.item.trace_id = trace.id
                trace.queued(request, job.enqueued_ns)
            return await loaded.scheduler.run(job), batch
        finally:
            if lease is not None:
                self.regions.release(lease)

    # -- statistics and repository ------------------------------------------------------
    def statistics(self, name: str = "", version: str = "") -> list[ModelStatistics]:
        if name:  # Triton's statistics refuse an unknown model or version as INVALID_ARG
            entry = self.manager.entry(name)
            if entry is None or not entry.versions:
                raise errors.InvalidArgumentError(f"requested model '{name}' is not available")
            if not version:
                return [v.stats.snapshot() for v in entry.versions.values()]
            found = entry.versions.get(int(version)) if version.isdigit() else None
            if found is None:
                raise errors.InvalidArgumentError(
                    f"requested model version is not available for model '{name}'"
                )
            return [found.stats.snapshot()]
        return [s.snapshot() for s in self.manager.all_stats()]

    @property
    def log_settings(self) -> dict[str, Any]:
        return self._log.values

    def update_log_settings(self, settings: dict[str, Any]) -> dict[str, Any]:
        return self._log.update(settings)
