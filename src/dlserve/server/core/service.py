"""The one entry point of the frontends: everything the protocols can ask for. Requests
go through its :class:`~dlserve.server.core.pipeline.RequestPipeline`; client shared
memory and the repository extension are collaborators it owns (``service_api.py``)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.registry import Collector

from dlserve import __version__, errors
from dlserve.server.core.cache.cache_config import CacheSettings
from dlserve.server.core.cache.response_cache import CacheCollector, ResponseCache
from dlserve.server.core.calls.bls_router import BlsRouter
from dlserve.server.core.models.config import config_to_dict
from dlserve.server.core.models.manager import UNLOADED, ManagerOptions, ModelManager
from dlserve.server.core.models.poller import RepositoryPoller
from dlserve.server.core.models.repository import Repository
from dlserve.server.core.pipeline import RequestPipeline
from dlserve.server.core.raw_input import raw_input
from dlserve.server.core.service_api import RepositoryApi, SharedMemoryApi
from dlserve.server.core.shm.owners import OwnerOptions, ReclaimCollector, RegionOwners
from dlserve.server.core.shm.region_metrics import RegionCollector
from dlserve.server.core.shm.registry import AllowClientShm, RegionRegistry
from dlserve.server.core.telemetry.log_settings import LogSettings
from dlserve.server.core.telemetry.metrics import Metrics
from dlserve.server.core.telemetry.system_metrics import SystemCollector
from dlserve.server.core.telemetry.tracer import Tracer
from dlserve.types import (
    InputTensor,
    ModelMetadata,
    ModelState,
    ModelStatistics,
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


class InferenceService:
    def __init__(self, repository: Repository, options: ServiceOptions) -> None:
        self.repository = repository
        self.options = options
        self.regions = RegionRegistry(options.allow_client_shm)
        self.owners = RegionOwners([self.regions], options.owners)
        settings = options.cache
        self.cache = ResponseCache(settings.size) if settings is not None else None
        system = SystemCollector(options.cpu_metrics, options.gpu_metrics)
        collectors: list[Collector] = [
            ReclaimCollector(self.owners),
            RegionCollector(self.regions),
            system,
        ]
        if self.cache is not None:
            collectors.append(CacheCollector(self.cache))
        self.metrics = Metrics(lambda: self.manager.all_stats(), collectors)
        self.bls = BlsRouter(self)
        self.manager = ModelManager(
            repository, options.manager, self.metrics.custom, self.bls, self.cache
        )
        self.manager.on_change = self.bls.direct.changed
        self.bls.direct.enabled = options.bls_direct
        self.pipeline = RequestPipeline(self.manager, repository, self.regions)
        # the frontends' request entry points are the pipeline's methods themselves: a
        # request pays no call of the service's own
        self.version = self.pipeline.version
        self.infer = self.pipeline.infer
        self.infer_stream = self.pipeline.stream
        self.shared_memory = SharedMemoryApi(self.regions, self.owners)
        self.repository_api = RepositoryApi(repository, self.manager, options.model_control_mode)
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

    # -- statistics and logging ---------------------------------------------------------
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
