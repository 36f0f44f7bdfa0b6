"""The instances of one model version: start them, say which are live and on which GPU,
restart the dead (the scheduler picks the instance for each request)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from dlserve import errors
from dlserve.ipc import messages as m
from dlserve.server.core.instances.environments import ExecEnv
from dlserve.server.core.instances.handle import CallSink, Launcher, MetricSink, WorkerHandle
from dlserve.server.core.instances.process import ProcessLauncher
from dlserve.server.core.instances.thread import ThreadLauncher

log = logging.getLogger("dlserve.workers")

RESTART_BACKOFF_S = (0.1, 0.5, 1.0, 2.0, 5.0)


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    name: str
    kind: str  # "CPU" or "GPU"
    device_id: int


async def spawn_worker(
    label: str, in_process: bool, on_metric: MetricSink | None, calls: CallSink | None = None,
    exec_env: ExecEnv | None = None,
) -> WorkerHandle:  # fmt: skip
    """A started worker (``exec_env``: in the model's own Python environment)."""
    if in_process and exec_env is not None:
        raise errors.InvalidArgumentError(
            f"'{label}': a model with its own Python environment (EXECUTION_ENV_PATH) needs a "
            "worker process; in-process workers (--debug) run in the server's Python"
        )
    launcher: Launcher = ThreadLauncher() if in_process else ProcessLauncher(exec_env)
    worker = WorkerHandle(label, launcher, on_metric=on_metric, calls=calls)
    try:
        await worker.spawn()
    except BaseException:
        worker.release_resources()
        raise
    return worker


def load_message(template: m.Load, spec: InstanceSpec) -> m.Load:
    return msgspec.structs.replace(
        template,
        instance_name=spec.name,
        instance_kind=spec.kind,
        device_id=spec.device_id,
    )


class WorkerPool:
    """Holds one worker per instance; a dead worker fails its own requests and is replaced."""

    def __init__(
        self,
        specs: list[InstanceSpec],
        template: m.Load,
        *,
        in_process: bool,
        on_metric: MetricSink | None,
        load_timeout: float,
        calls: CallSink | None = None,
        exec_env: ExecEnv | None = None,
    ) -> None:
        self.specs = specs
        self.exec_env = exec_env
        self.template = template
        # each instance as a BLS call chain names it (an instance in a request's chain
        # waits for that request: it must not get it)
        self.chain_entries = [
            m.chain_entry(template.model_name, template.model_version, spec.name) for spec in specs
        ]
        self.in_process = in_process
        self.on_metric = on_metric
        self.calls = calls
        self.load_timeout = load_timeout
        self.workers: list[WorkerHandle | None] = [None] * len(specs)
        self._watchers: list[asyncio.Task[None]] = []
        self._stopping = False
        self.restarts = 0
        self.on_restart: Callable[[], None] | None = None  # an instance is back: use it

    async def start(self, first: WorkerHandle | None = None) -> None:
        """Start every instance (reusing ``first`` for instance 0); all or nothing."""
        starts = [
            self._start_instance(i, first if i == 0 else None) for i in range(len(self.specs))
        ]
        results = await asyncio.gather(*starts, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self.stop(timeout=5.0)
            raise failures[0]
        self._watchers = [asyncio.create_task(self._watch(i)) for i in range(len(self.specs))]

    async def _start_instance(self, index: int, worker: WorkerHandle | None) -> None:
        spec = self.specs[index]
        if worker is None:
            worker = await spawn_worker(
                spec.name, self.in_process, self.on_metric, self.calls, self.exec_env
            )
        try:
            await worker.load(load_message(self.template, spec), self.load_timeout)
        except BaseException:
            await worker.stop(timeout=5.0)
            raise
        self.workers[index] = worker

    async def _watch(self, index: int) -> None:
        attempt = 0
        while not self._stopping:
            worker = self.workers[index]
            assert worker is not None
            reason = await worker.closed
            if self._stopping:
                return
            self.workers[index] = None
            await worker.stop(timeout=1.0)
            log.error("%s Restarting it.", reason)
            await asyncio.sleep(RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)])
            try:
                await self._start_instance(index, None)
                attempt = 0
                self.restarts += 1
                log.info("model instance '%s' restarted", self.specs[index].name)
                if self.on_restart is not None:
                    self.on_restart()
            except errors.DlserveError as exc:
                attempt += 1
                log.error("restarting model instance '%s' failed: %s", self.specs[index].name, exc)

    @property
    def ready(self) -> bool:
        for worker in self.workers:  # asked for every request: no generator
            if worker is None or not worker.alive:
                return False
        return True

    def live(self) -> list[WorkerHandle]:
        """The instances that can take work now."""
        return [w for w in self.workers if w is not None and w.alive]

    def upstream(self, worker: WorkerHandle, chain: list[str]) -> bool:
        """Whether ``worker`` is in a request's BLS call chain (waiting for the request)."""
        for entry, one in zip(self.chain_entries, self.workers, strict=True):
            if one is worker:
                return entry in chain
        return False

    def on_device(self, device: int) -> list[WorkerHandle]:
        """The live instances on GPU ``device``."""
        return [
            worker
            for spec, worker in zip(self.specs, self.workers, strict=True)
            if spec.kind == "GPU" and spec.device_id == device
            and worker is not None and worker.alive
        ]  # fmt: skip

    def gpu_of(self, worker: WorkerHandle) -> int | None:
        """The GPU an instance is on (None for a CPU instance, or one not in the pool)."""
        for spec, one in zip(self.specs, self.workers, strict=True):
            if one is worker:
                return spec.device_id if spec.kind == "GPU" else None
        return None

    async def stop(self, timeout: float) -> None:
        self._stopping = True
        for task in self._watchers:
            task.cancel()
        stops = [w.stop(timeout) for w in self.workers if w is not None]
        self.workers = [None] * len(self.specs)
        await asyncio.gather(*stops, return_exceptions=True)
