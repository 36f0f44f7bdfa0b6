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
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from dlserve import errors
from dlserve.ipc import messages as m
from dlserve.server.core import classification
from dlserve.server.core.cache.cache_config import check_ensemble_steps
from dlserve.server.core.cache.response_cache import ResponseCache, model_cache
from dlserve.server.core.calls.ensemble import EnsemblePlan, plan_ensemble
from dlserve.server.core.host.devices import gpu_count
from dlserve.server.core.instances import environments, polling
from dlserve.server.core.instances.handle import CallSink, WorkerHandle
from dlserve.server.core.instances.pool import WorkerPool, spawn_worker
from dlserve.server.core.models import config as cfg
from dlserve.server.core.models import warmup
from dlserve.server.core.models.repository import ModelSource, Repository, select_versions
from dlserve.server.core.models.versions import UNLOADED as UNLOADED
from dlserve.server.core.models.versions import ModelEntry as ModelEntry
from dlserve.server.core.models.versions import ModelVersion as ModelVersion
from dlserve.server.core.models.versions import instance_specs
from dlserve.server.core.request_validator import RequestValidator
from dlserve.server.core.scheduling.iterative import IterativeScheduler
from dlserve.server.core.scheduling.scheduler import Scheduler
from dlserve.server.core.scheduling.sequences import SequenceScheduler
from dlserve.server.core.telemetry.metrics import CustomMetrics
from dlserve.server.core.telemetry.stats import ModelStats
from dlserve.types import ModelState

log = logging.getLogger("dlserve.models")


REPLY_POLL_US = polling.REPLY_POLL_US
REQUEST_POLL_US = polling.REQUEST_POLL_US


@dataclass(slots=True)
class ManagerOptions:
    in_process: bool = False
    busy_poll_us: int = 0  # workers poll for requests this long before sleeping
    reply_poll_us: int = REPLY_POLL_US  # the server polls for a worker's reply this long
    request_poll_us: int = REQUEST_POLL_US  # a worker polls for its next request this long
    load_timeout: float = 300.0
    stop_timeout: float = 30.0
    auto_complete: bool = True  # call the models' auto_complete_config (Triton's default)


class ModelManager:
    def __init__(
        self,
        repository: Repository,
        options: ManagerOptions,
        custom: CustomMetrics,
        calls: CallSink | None = None,
        cache: ResponseCache | None = None,
    ) -> None:
        self.repository = repository
        self.cache = cache  # the server's response cache (--cache-config), if any
        self.options = options
        polling.set_busy_poll(options.busy_poll_us, options.reply_poll_us, options.request_poll_us)
        self.custom = custom
        self.calls = calls  # where workers' BLS calls go
        self.models: dict[str, ModelEntry] = {}
        self.on_change: Callable[[str], None] | None = None  # a model's versions changed
        self._loading_ensembles: set[str] = set()
        self.environments = environments.Environments()  # EXECUTION_ENV_PATH

    def entry(self, name: str) -> ModelEntry | None:
        return self.models.get(name)

    async def load(
        self, name: str, config_json: str | None = None, files: Mapping[str, bytes] | None = None
    ) -> None:
        """(Re)load a model; raises the reason it could not be loaded. ``files``: the
        model's files, sent with the request (``file:<path>`` -> bytes).

        A model that is loaded serves on while its new versions start, as in Triton: they
        replace it once they are ready (no loss of availability), and if they cannot
        start it stays as it was."""
        entry = self.models.get(name)
        if entry is None:
            entry = self.models[name] = ModelEntry(name, ModelState.LOADING)
        async with entry.lock:
            serving = entry.state == ModelState.READY and bool(entry.versions)
            if not serving:
                await self._unload_locked(entry)
                entry.state, entry.reason = ModelState.LOADING, ""
            source = None
            try:
                source = self.repository.source(name, config_json, files)
                config, versions = await self._start(source)
            except errors.DlserveError as exc:
                self._failed_load(entry, serving, exc, source)
                raise
            old_versions, old_path = (entry.versions, entry.path) if serving else ({}, None)
            entry.path, entry.config, entry.versions = source.path, config, versions
            entry.state, entry.reason = ModelState.READY, ""
            log.info("model '%s' versions %s are READY", name, sorted(entry.versions))
            self._changed(name)
            if old_versions:  # in-flight requests of the old versions finish first
                timeout = self.options.stop_timeout
                await asyncio.gather(*(v.stop(timeout) for v in old_versions.values()))
            if old_path is not None and old_path != source.path:
                self.repository.forget(old_path)

    def _failed_load(
        self, entry: ModelEntry, serving: bool, exc: errors.DlserveError,
        source: ModelSource | None,
    ) -> None:  # fmt: skip
        if serving:
            if source is not None and source.path != entry.path:
                self.repository.forget(source.path)  # files sent with the failed request
            log.error("model '%s' could not be reloaded; the loaded one serves on: %s",
                      entry.name, exc)  # fmt: skip
            return
        if source is not None:
            entry.path = source.path  # forgotten when the model is next loaded or unloaded
        entry.state, entry.reason = ModelState.UNAVAILABLE, str(exc)
        log.error("model '%s' is UNAVAILABLE: %s", entry.name, exc)

    async def _start(self, source: ModelSource) -> tuple[Any, dict[int, ModelVersion]]:
        name = source.name
        raw = source.config
        raw.name = raw.name or name
        if cfg.is_ensemble(raw):
            return await self._start_ensemble(source, raw)
        chosen = select_versions(source, raw)
        wanted = environments.requested(raw.parameters, source.path)
        exec_env = None if wanted is None else await self.environments.prepare(wanted, name)
        first: WorkerHandle | None = await spawn_worker(  # named as Triton names its stub
            name, self.options.in_process, self.custom.handle, self.calls,
            exec_env,
        )  # fmt: skip
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
                versions[version] = await self._start_version(
                    source, version, config, first, exec_env
                )
                first = None
        except BaseException:
            if first is not None:
                await first.stop(timeout=5.0)
            await asyncio.gather(*(v.stop(5.0) for v in versions.values()))
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
        self, source: ModelSource, version: int, raw: Any, worker: WorkerHandle
    ) -> Any:
        template = self._template(source, version, raw, autocomplete=True)
        msg = msgspec.structs.replace(  # without auto-complete: the model is only imported
            template,
            instance_name=source.name,
            autocomplete=self.options.auto_complete,
        )
        loaded = await worker.load(msg, self.options.load_timeout)
        config = cfg.config_from_json(
            loaded.config_json, f"auto_complete_config of '{source.name}'"
        )
        cfg.normalize(config, source.name, gpu_count())
        return config

    async def _start_version(
        self, source: ModelSource, version: int, config: Any, first: WorkerHandle | None,
        exec_env: environments.ExecEnv | None,
    ) -> ModelVersion:  # fmt: skip
        template = self._template(source, version, config, autocomplete=False)
        samples = warmup.plan(config, source.path)
        labels = classification.load_labels(config, source.path)
        pool = WorkerPool(
            instance_specs(config),
            template,
            in_process=self.options.in_process,
            on_metric=self.custom.handle,
            load_timeout=self.options.load_timeout,
            calls=self.calls,
            exec_env=exec_env,
        )
        await pool.start(first)
        try:
            await warmup.run(pool, samples)
        except BaseException:
            await pool.stop(timeout=5.0)
            raise
        stats = ModelStats(source.name, str(version))
        kind: type[Scheduler] = Scheduler
        if config.HasField("sequence_batching"):
            iterative = config.sequence_batching.iterative_sequence
            kind = IterativeScheduler if iterative else SequenceScheduler
        scheduler = kind(source.name, pool, config, stats)
        return ModelVersion(
            source.name, version, config, RequestValidator(config), stats, pool, scheduler,
            labels=labels, cache=model_cache(self.cache, config, stats),
        )  # fmt: skip

    # -- ensembles ----------------------------------------------------------------------
    async def _start_ensemble(
        self, source: ModelSource, config: Any
    ) -> tuple[Any, dict[int, ModelVersion]]:
        """Check the plan and that every step's model is loaded (loading the ones never
        loaded, as Triton does); the ensemble is READY while its steps are."""
        cfg.normalize(config, source.name, gpu_count())
        plan = plan_ensemble(config)
        missing = [m for m in plan.models if m not in self.models and
                   m not in self.repository.model_names()]  # fmt: skip
        if missing:
            raise cfg.ConfigError(
                f"ensemble {source.name} contains models that are not available or "
                f"ambiguous: {', '.join(missing)}"
            )
        for model in plan.models:
            await self._require_step(source.name, model)
        for step in plan.steps:
            entry = self.models[step.model_name]
            if step.model_version and int(step.model_version) not in entry.versions:
                raise errors.UnavailableError(
                    f"ensemble '{source.name}' depends on '{step.model_name}' whose required "
                    f"version {step.model_version} is not loaded."
                )
        if config.response_cache.enable:  # not over a stateful or decoupled step
            check_ensemble_steps(source.name, config, lambda m: self.models[m].config)
        steps_ready = functools.partial(self._steps_ready, plan)
        labels = classification.load_labels(config, source.path)
        versions: dict[int, ModelVersion] = {}
        for v in select_versions(source, config):
            stats = ModelStats(source.name, str(v))
            cache = model_cache(self.cache, config, stats)
            versions[v] = ModelVersion(
                source.name, v, config, RequestValidator(config), stats, ensemble=plan,
                steps_ready=steps_ready, labels=labels, cache=cache,
            )  # fmt: skip
        return config, versions

    async def _require_step(self, ensemble: str, model: str) -> None:
        if model == ensemble or model in self._loading_ensembles:
            raise cfg.ConfigError(f"circular dependency between ensembles: '{ensemble}'")
        entry = self.models.get(model)
        if entry is None:  # never loaded: load it now
            self._loading_ensembles.add(ensemble)
            try:
                await self.load(model)
            except errors.DlserveError:
                pass
            finally:
                self._loading_ensembles.discard(ensemble)
            entry = self.models[model]
        else:
            async with entry.lock:  # a load in progress: wait for its outcome
                pass
        if entry.state != ModelState.READY or not entry.versions:
            why = (
                f" Model '{model}' loading failed with error: {entry.reason}"
                if entry.reason
                else ""
            )
            raise errors.UnavailableError(
                f"ensemble '{ensemble}' depends on '{model}' which has no loaded version.{why}"
            )

    def _steps_ready(self, plan: EnsemblePlan) -> bool:
        for step in plan.steps:
            entry = self.models.get(step.model_name)
            if entry is None or entry.state != ModelState.READY:
                return False
            if step.model_version:
                version = entry.versions.get(int(step.model_version))
                if version is None or not version.ready:
                    return False
            elif entry.latest_ready() is None:
                return False
        return True

    async def unload(self, name: str) -> None:
        entry = self.models.get(name)
        if entry is None:
            return
        async with entry.lock:
            await self._unload_locked(entry)
            entry.state, entry.reason = ModelState.UNAVAILABLE, UNLOADED

    def _changed(self, name: str) -> None:
        if self.on_change is not None:
            self.on_change(name)

    async def _unload_locked(self, entry: ModelEntry) -> None:
        if entry.versions:
            entry.state = ModelState.UNLOADING
            versions, entry.versions = entry.versions, {}
            self._changed(entry.name)
            await asyncio.gather(*(v.stop(self.options.stop_timeout) for v in versions.values()))
        if entry.path is not None:  # files sent with its load request go with it
            self.repository.forget(entry.path)
            entry.path = None

    async def unload_all(self) -> None:
        """Unload every model (the server stops): extracted environments go too."""
        await asyncio.gather(*(self.unload(name) for name in list(self.models)))
        self.environments.close()

    def all_stats(self) -> list[ModelStats]:
        return [v.stats for e in self.models.values() for v in e.versions.values()]
