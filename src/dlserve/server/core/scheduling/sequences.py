"""Triton's sequence batcher (the direct strategy), for models with ``sequence_batching``.

Each instance has ``max(1, max_batch_size)`` sequence slots. A request with the START
flag binds its correlation id to a free slot (on the instance with the fewest bound
sequences), or, when every slot is taken, to the backlog, where its requests collect
until a slot frees. From then on every request of the sequence goes to that slot, and
a slot gives the instance at most one request per ``execute``, so a sequence's requests
run in order on one instance while other sequences run on the others. The slot frees
when the END request is sent, when the sequence has been idle for
``max_sequence_idle_microseconds`` (Triton's reaper: later requests of it need a new
START), or when a queued request of it is cancelled (the rest of it is cancelled too).

The server adds the control inputs the config asks for (START, END, READY, CORRID) to
each request, with a batch dimension of 1 when ``max_batch_size`` > 0; the model reads
the id and flags as ``request.correlation_id()`` and ``request.flags()``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from dlserve import errors
from dlserve.server.core.instances.handle import WorkItem
from dlserve.server.core.instances.pool import WorkerPool
from dlserve.server.core.instances.replies import WorkerReply
from dlserve.server.core.scheduling.queues import Job
from dlserve.server.core.scheduling.scheduler import Scheduler, fail_job
from dlserve.server.core.scheduling.sequence_config import (
    END,
    FLAG_END,
    FLAG_START,
    START,
    SequenceSettings,
)
from dlserve.server.core.telemetry.stats import ModelStats
from dlserve.types import InputTensor

log = logging.getLogger("dlserve.scheduler")

CorrelationId = int | str
_INT_SIZES = {"UINT64": 8, "INT64": 8, "UINT32": 4, "INT32": 4}


@dataclass(slots=True, eq=False)
class _Sequence:
    correlation_id: CorrelationId
    jobs: deque[Job] = field(default_factory=deque)  # queued, in arrival order
    slot: int = -1  # -1: in the backlog
    last_ns: int = 0  # when its latest request arrived (the idle timeout counts from it)
    ended: bool = False  # takes no more requests: its slot frees once its queue is sent


class SequenceScheduler(Scheduler):
    def __init__(self, name: str, pool: WorkerPool, config: Any, stats: ModelStats) -> None:
        super().__init__(name, pool, config, stats)
        self._prefetch = False  # requests wait in their slots and sequences, not at an instance
        self.settings = SequenceSettings.from_config(config)
        self._instances = len(pool.workers)
        # slot s belongs to instance s % instances
        self._slots: list[_Sequence | None] = [None] * (self._instances * self.settings.slots)
        self._sequences: dict[CorrelationId, _Sequence] = {}  # the ones taking requests
        self._backlog: deque[_Sequence] = deque()
        self._queued = 0
        self._rebound = False  # a backlogged sequence got a slot during dispatch
        self._reaper: asyncio.TimerHandle | None = None
        self._stopped = False

    # -- a request's way in ----------------------------------------------------------------
    async def _run(self, job: Job) -> WorkerReply | None:
        sequence = self._route(job)
        self.dispatch()
        try:
            return await job.future
        except asyncio.CancelledError:
            if job in sequence.jobs:  # still queued: the sequence ends here, as in Triton
                self._cancel(sequence, job)
            elif job.sent is not None:  # executing: the model sees is_cancelled()
                job.sent[0].cancel(job.sent[1])
            raise

    def _route(self, job: Job) -> _Sequence:
        """Check ``job`` against the sequences and queue it on its sequence (Triton's
        checks and messages); raises for a request that cannot be part of one."""
        item = job.item
        corrid, flags = item.correlation_id, item.flags
        self._check(item, job.batch)
        sequence = self._sequences.get(corrid)
        if sequence is None:
            if not flags & FLAG_START:
                raise errors.InvalidArgumentError(
                    f"inference request for sequence {corrid} to model '{self.name}' must "
                    "specify the START flag on the first request of the sequence"
                )
            sequence = self._sequences[corrid] = _Sequence(corrid)
            self._bind(sequence)
        elif flags & FLAG_START:
            log.warning(
                "sequence %s for model '%s' has a conflict. The previous sequence did not end "
                "before this sequence start. Previous sequence will be terminated early.",
                corrid, self.name,
            )  # fmt: skip
        item.inputs = [*item.inputs, *self._controls(item)]
        sequence.jobs.append(job)
        self._queued += 1
        sequence.last_ns = job.enqueued_ns
        if flags & FLAG_END:  # a later START with this id begins a new sequence
            sequence.ended = True
            del self._sequences[corrid]
        self._arm_reaper()
        return sequence

    def _check(self, item: WorkItem, batch: int) -> None:
        if self._stopped:
            raise errors.UnavailableError(f"model '{self.name}' is being unloaded")
        if not self._any_live():
            raise errors.UnavailableError(
                f"no instance of model '{self.name}' is available (restarting)"
            )
        corrid = item.correlation_id
        if corrid == 0 or corrid == "":
            raise errors.InvalidArgumentError(
                f"inference request to model '{self.name}' must specify a non-zero or "
                "non-empty correlation ID"
            )
        if self.settings.batched and batch > 1:
            raise errors.InvalidArgumentError(
                f"inference request to model '{self.name}' must specify batch-size 1 due to "
                "requirements of sequence batcher"
            )
        control = self.settings.corrid
        if control is not None:
            given = "BYTES" if isinstance(corrid, str) else "UINT64"
            if (given == "BYTES") != (control.datatype == "BYTES"):
                raise errors.InvalidArgumentError(
                    f"sequence batching control '{control.name}' data-type is '{given}', but "
                    f"model '{self.name}' expects '{control.datatype}'"
                )

    def _controls(self, item: WorkItem) -> list[InputTensor]:
        """The control inputs of ``item``, as the config describes them."""
        settings = self.settings
        shape = (1, 1) if settings.batched else (1,)
        tensors = []
        for control in settings.controls:
            if control.kind == START:
                on = bool(item.flags & FLAG_START)
            elif control.kind == END:
                on = bool(item.flags & FLAG_END)
            else:  # READY: every request the model gets is ready (no padding requests)
                on = True
            value = control.true if on else control.false
            tensors.append(InputTensor(control.name, control.datatype, shape, memoryview(value)))
        if settings.corrid is not None:
            data = _corrid_bytes(item.correlation_id, settings.corrid.datatype)
            tensors.append(InputTensor(settings.corrid.name, settings.corrid.datatype, shape, data))
        return tensors

    # -- slots -----------------------------------------------------------------------------
    def _bind(self, sequence: _Sequence) -> None:
        """A free slot for ``sequence`` (on the least loaded instance), else the backlog."""
        free = [slot for slot, held in enumerate(self._slots) if held is None]
        if not free:
            self._backlog.append(sequence)
            return
        count = self._instances
        load = Counter(slot % count for slot, held in enumerate(self._slots) if held is not None)
        slot = min(free, key=lambda s: (load[s % count], s))
        self._slots[slot] = sequence
        sequence.slot = slot

    def _release(self, sequence: _Sequence) -> None:
        """``sequence`` leaves its slot; the oldest backlogged sequence takes one."""
        self._slots[sequence.slot] = None
        sequence.slot = -1
        if self._backlog:
            self._bind(self._backlog.popleft())
            self._rebound = True

    def _cancel(self, sequence: _Sequence, job: Job) -> None:
        """A queued request's client went away: its sequence ends, what else of it waits
        is cancelled, and its slot frees."""
        failure = errors.CancelledError("Request was cancelled")
        self._queued -= len(sequence.jobs)
        for other in sequence.jobs:
            if other is not job:
                fail_job(other, failure)
        sequence.jobs.clear()
        self._end(sequence)
        self.dispatch()

    def _end(self, sequence: _Sequence) -> None:
        if self._sequences.get(sequence.correlation_id) is sequence:
            del self._sequences[sequence.correlation_id]
        sequence.ended = True
        if sequence.slot >= 0 and not sequence.jobs:
            self._release(sequence)
        elif sequence.slot < 0 and not sequence.jobs and sequence in self._backlog:
            self._backlog.remove(sequence)

    # -- dispatch --------------------------------------------------------------------------
    def dispatch(self) -> None:
        """Each free instance gets the next request of every sequence bound to it."""
        self._rebound = True
        while self._rebound:
            self._rebound = False
            for index, worker in enumerate(self.pool.workers):
                if worker is None or not worker.alive or worker in self._busy:
                    continue
                jobs = self._take(index)
                if jobs:
                    self._send(worker, jobs)
        if self._queued and not self._any_live():
            self._fail_all(
                errors.UnavailableError(
                    f"no instance of model '{self.name}' is available (restarting)"
                )
            )
        self.stats.pending = self._queued
        idle = self._idle
        if not self._queued and self._is_idle() and idle is not None and not idle.done():
            idle.set_result(None)

    def _take(self, index: int) -> list[Job]:
        jobs = []
        for slot in range(index, len(self._slots), self._instances):
            sequence = self._slots[slot]
            if sequence is None or not sequence.jobs:
                continue
            jobs.append(sequence.jobs.popleft())
            self._queued -= 1
            if sequence.ended and not sequence.jobs:  # its END goes out: the slot frees
                self._release(sequence)
        return jobs

    def _waiting(self) -> int:
        return self._queued

    # -- idle sequences ----------------------------------------------------------------------
    def _arm_reaper(self) -> None:
        if self._reaper is not None:
            return
        bound = [s.last_ns for s in self._sequences.values() if s.slot >= 0]
        if not bound:
            return
        delay = min(bound) + self.settings.idle_ns - time.monotonic_ns()
        self._reaper = self._loop.call_later(max(delay, 0) / 1e9, self._reap)

    def _reap(self) -> None:
        """Sequences idle for max_sequence_idle_microseconds lose their slot; what of them
        is queued still runs, and a later request of them needs a new START."""
        self._reaper = None
        now = time.monotonic_ns()
        for sequence in list(self._sequences.values()):
            if sequence.slot >= 0 and now - sequence.last_ns >= self.settings.idle_ns:
                log.debug("sequence %s of model '%s' idle: its slot is released",
                          sequence.correlation_id, self.name)  # fmt: skip
                self._end(sequence)
        self._arm_reaper()
        self.dispatch()

    # -- unload ------------------------------------------------------------------------------
    def _fail_all(self, failure: errors.DlserveError) -> None:
        for sequence in [*self._slots, *self._backlog]:
            if sequence is not None:
                for job in sequence.jobs:
                    fail_job(job, failure)
                sequence.jobs.clear()
        self._queued = 0

    def stop(self) -> None:
        """The version goes away: what waits fails, every sequence ends."""
        super().stop()
        self._stopped = True
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        self._fail_all(errors.UnavailableError(f"model '{self.name}' is being unloaded"))
        self._sequences.clear()
        self._backlog.clear()
        self._slots = [None] * len(self._slots)


def _corrid_bytes(corrid: CorrelationId, datatype: str) -> memoryview:
    """The CORRID input's bytes: a serialized string, or the id in the integer type
    (the low bytes of the 64-bit id, as Triton copies them)."""
    if isinstance(corrid, str):
        text = corrid.encode()
        return memoryview(len(text).to_bytes(4, "little") + text)
    size = _INT_SIZES[datatype]
    return memoryview((corrid % (1 << (8 * size))).to_bytes(size, "little"))
