"""What the manager holds per model: its entry (state, versions) and each loaded version
(a pool of workers and its scheduler, or an ensemble's plan); and the instances a
version's config asks for."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from dlserve.server.core.cache.response_cache import ModelCache
from dlserve.server.core.calls.ensemble import EnsemblePlan
from dlserve.server.core.instances.pool import InstanceSpec, WorkerPool
from dlserve.server.core.request_validator import RequestValidator
from dlserve.server.core.scheduling.scheduler import Scheduler
from dlserve.server.core.streaming import OpenStreams
from dlserve.server.core.telemetry.stats import ModelStats
from dlserve.types import ModelState


@dataclass(
    slots=True, weakref_slot=True, eq=False
)  # weakly held by server/core/calls/direct_broker.py
class ModelVersion:
    """A loaded version: a pool of workers and its scheduler, or an ensemble's plan."""

    name: str
    version: int
    config: Any
    validator: RequestValidator
    stats: ModelStats
    pool: WorkerPool | None = None
    scheduler: Scheduler | None = None
    ensemble: EnsemblePlan | None = None
    steps_ready: Callable[[], bool] | None = None  # an ensemble: are its steps ready?
    labels: dict[str, list[str]] = field(default_factory=dict)  # outputs' label files
    decoupled: bool = field(init=False)  # from the config, read once
    streams: OpenStreams = field(default_factory=OpenStreams)  # stop() waits for them
    cache: ModelCache | None = None  # its use of the server's response cache

    def __post_init__(self) -> None:
        self.decoupled = bool(self.config.model_transaction_policy.decoupled)

    @property
    def ready(self) -> bool:
        if self.pool is not None:
            return self.pool.ready
        return self.steps_ready is not None and self.steps_ready()

    async def stop(self, timeout: float) -> None:
        """Finish what was accepted (within ``timeout``), then stop the workers. A decoupled
        request still streaming past the deadline (its client reads too slowly, or not at
        all, so its model waits for credit) ends with an UNAVAILABLE error."""
        deadline = time.monotonic() + timeout
        if self.cache is not None:  # its responses go, and what it answers now is not kept
            self.cache.close()
        if self.scheduler is not None:
            await self.scheduler.drain(timeout)
        await self.streams.drain(deadline, self.name)
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.pool is not None:
            await self.pool.stop(max(deadline - time.monotonic(), _FINALIZE_FLOOR_S))


_FINALIZE_FLOOR_S = 0.5
"""What a worker has left to finalize when its requests ran past the deadline: the
exit timeout bounds the whole stop, not each of its steps."""

UNLOADED = "unloaded"  # the reason of a model unloaded on request (Triton's word)


@dataclass(slots=True)
class ModelEntry:
    """A model the server knows: its state, and its versions when loaded."""

    name: str
    state: ModelState
    reason: str = ""
    config: Any = None
    versions: dict[int, ModelVersion] = field(default_factory=dict)  # newest first
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    path: Path | None = None  # the folder it was loaded from

    def latest_ready(self) -> ModelVersion | None:
        for version in self.versions.values():
            if version.ready:
                return version
        return None


def instance_specs(config: Any) -> list[InstanceSpec]:
    """One per instance: ``count`` on each of a group's devices, named as Triton names them
    (``<group>_<i>``, i < count: a group on two GPUs has two instances of each name)."""
    specs: list[InstanceSpec] = []
    for group in config.instance_group:
        if group.kind == mc.ModelInstanceGroup.KIND_GPU:
            placements = [("GPU", gpu) for gpu in group.gpus]
        elif group.kind == mc.ModelInstanceGroup.KIND_MODEL:  # the model places itself
            placements = [("MODEL", 0)]
        else:
            placements = [("CPU", 0)]
        for kind, device in placements:
            for index in range(group.count):
                specs.append(InstanceSpec(f"{group.name}_{index}", kind, device))
    return specs
