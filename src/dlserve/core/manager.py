"""Loads, serves and unloads models: each loaded version owns a pool of workers.

Loading a model:
  1. read its config and version folders from the repository;
  2. start instance 0's worker and let model.py auto-complete the config;
  3. normalize the config (Triton's defaults) and pick the versions to serve;
  4. start every instance of every version; any failure makes the model
     UNAVAILABLE with the reason, and the other models go on serving.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import msgspec
from tritonclient.grpc import model_config_pb2 as mc

from dlserve import errors
from dlserve.core import config as cfg
from dlserve.core.devices import gpu_count
from dlserve.core.metrics import CustomMetrics
from dlserve.core.repository import ModelSource, Repository, select_versions
from dlserve.core.stats import ModelStats
from dlserve.core.validation import RequestValidator
from dlserve.ipc import messages as m
from dlserve.types import ModelState
from dlserve.workers.client import WorkerBase
from dlserve.workers.pool import InstanceSpec, WorkerPool, spawn_worker

log = logging.getLogger("dlserve.models")


@dataclass(slots=True)
class ManagerOptions:
    in_process: bool = False
    load_timeout: float = 300.0
    stop_timeout: float = 30.0


@dataclass(slots=True)
class ModelVersion:
    name: str
    version: int
    config: Any
    pool: WorkerPool
    validator: RequestValidator
    stats: ModelStats
    warned_cross_device: bool = False

    @property
    def ready(self) -> bool:
        return self.pool.ready


@dataclass(slots=True)
class ModelEntry:
    """A model the server knows: its state, and its versions when loaded."""

    name: str
    state: ModelState
    reason: str = ""
    config: Any = None
    versions: dict[int, ModelVersion] = field(default_factory=dict)  # newest first
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def latest_ready(self) -> ModelVersion | None:
        for version in self.versions.values():
            if version.ready:
                return version
        return None


def instance_specs(config: Any) -> list[InstanceSpec]:
    specs: list[InstanceSpec] = []
    for group in config.instance_group:
        if group.kind == mc.ModelInstanceGroup.KIND_GPU:
            placements = [("GPU", gpu) for gpu in group.gpus]
        else:
            placements = [("CPU", 0)]
        index = 0
        for kind, device in placements:
            for _ in range(group.count):
                specs.append(InstanceSpec(f"{group.name}_{index}", kind, device))
                index += 1
    return specs


class ModelManager:
    def __init__(
        self, repository: Repository, options: ManagerOptions, custom: CustomMetrics
    ) -> None:
        self.repository = repository
        self.options = options
        self.custom = custom
        self.models: dict[str, ModelEntry] = {}

    def entry(self, name: str) -> ModelEntry | None:
        return self.models.get(name)

    async def load(self, name: str, config_json: str | None = None) -> None:
        """(Re)load a model; raises the reason it could not be loaded."""
        entry = self.models.get(name)
        if entry is None:
            entry = self.models[name] = ModelEntry(name, ModelState.LOADING)
        async with entry.lock:
            await self._unload_locked(entry)
            entry.state, entry.reason = ModelState.LOADING, ""
            try:
                entry.config, entry.versions = await self._start(name, config_json)
            except errors.DlserveError as exc:
                entry.state, entry.reason = ModelState.UNAVAILABLE, str(exc)
                log.error("model '%s' is UNAVAILABLE: %s", name, exc)
                raise
            entry.state = ModelState.READY
            log.info("model '%s' versions %s are READY", name, sorted(entry.versions))

    async def _start(
        self, name: str, config_json: str | None
    ) -> tuple[Any, dict[int, ModelVersion]]:
        source = self.repository.source(name, config_json)
        raw = source.config
        raw.name = raw.name or name
        chosen = select_versions(source, raw)
        first: WorkerBase | None = await spawn_worker(
            f"{name}_autocomplete", self.options.in_process, self.custom.handle
        )
        assert first is not None
        try:
            config = await self._auto_complete(source, chosen[0], raw, first)
            chosen = select_versions(source, config)
        except BaseException:
            await first.stop(timeout=5.0)
            raise
        versions: dict[int, ModelVersion] = {}
        try:
            for version in chosen:
                versions[version] = await self._start_version(source, version, config, first)
                first = None
        except BaseException:
            if first is not None:
                await first.stop(timeout=5.0)
            await asyncio.gather(*(v.pool.stop(5.0) for v in versions.values()))
            raise
        return config, versions

    def _template(
        self, source: ModelSource, version: int, config: Any, *, autocomplete: bool
    ) -> m.Load:
        return m.Load(
            model_name=source.name,
            model_version=version,
            repository=str(self.repository.root),
            model_path=str(source.path),
            model_file=str(source.versions[version].resolve()),
            config_json=cfg.config_to_json(config),
            instance_name="",
            instance_kind="CPU",
            device_id=0,
            autocomplete=autocomplete,
            initialize=not autocomplete,
        )

    async def _auto_complete(
        self, source: ModelSource, version: int, raw: Any, worker: WorkerBase
    ) -> Any:
        template = self._template(source, version, raw, autocomplete=True)
        msg = msgspec.structs.replace(
            template,
            instance_name=f"{source.name}_autocomplete",
        )
        loaded = await worker.load(msg, self.options.load_timeout)
        config = cfg.config_from_json(
            loaded.config_json, f"auto_complete_config of '{source.name}'"
        )
        cfg.normalize(config, source.name, gpu_count())
        return config

    async def _start_version(
        self, source: ModelSource, version: int, config: Any, first: WorkerBase | None
    ) -> ModelVersion:
        template = self._template(source, version, config, autocomplete=False)
        pool = WorkerPool(
            instance_specs(config),
            template,
            in_process=self.options.in_process,
            on_metric=self.custom.handle,
            load_timeout=self.options.load_timeout,
        )
        await pool.start(first)
        stats = ModelStats(source.name, str(version))
        return ModelVersion(source.name, version, config, pool, RequestValidator(config), stats)

    async def unload(self, name: str) -> None:
        entry = self.models.get(name)
        if entry is None:
            return
        async with entry.lock:
            await self._unload_locked(entry)
            entry.state, entry.reason = ModelState.UNAVAILABLE, "unloaded"

    async def _unload_locked(self, entry: ModelEntry) -> None:
        if not entry.versions:
            return
        entry.state = ModelState.UNLOADING
        versions, entry.versions = entry.versions, {}
        await asyncio.gather(*(v.pool.stop(self.options.stop_timeout) for v in versions.values()))

    async def unload_all(self) -> None:
        await asyncio.gather(*(self.unload(name) for name in list(self.models)))

    def all_stats(self) -> list[ModelStats]:
        return [v.stats for e in self.models.values() for v in e.versions.values()]
