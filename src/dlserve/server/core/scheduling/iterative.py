"""Triton's iterative sequences: ``sequence_batching { iterative_sequence: true }``.

Continuous batching for models that work on a request over several ``execute`` calls (a
generation loop, one step per call). Each request is a sequence of its own: it takes a
slot of one instance (``max(1, max_batch_size)`` slots each, on the instance with the
fewest requests; when every slot is taken it waits in a backlog, oldest first) and keeps
it until it is done. A free instance executes every request in its slots at once, new
and rescheduled alike. The model calls
``request.set_release_flags(TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)`` on each request it
has not finished; the others are done when ``execute`` returns (a decoupled request: at
its final flag), and their slots go to the backlog.

A rescheduled request goes to the worker again under the same rid, so a decoupled
request's responses, whichever ``execute`` sends them, stay one stream. A request whose
client goes away while it waits between two executes is not run again.
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter, deque
from typing import Any

from dlserve import errors
from dlserve.server.core.instances.handle import WorkerHandle
from dlserve.server.core.instances.pending import ReplyCallback
from dlserve.server.core.instances.pool import WorkerPool
from dlserve.server.core.instances.replies import Outcome, WorkerReply
from dlserve.server.core.scheduling.executions import Execution
from dlserve.server.core.scheduling.queues import Job
from dlserve.server.core.scheduling.scheduler import Scheduler, fail_job
from dlserve.server.core.telemetry.stats import ModelStats


class IterativeScheduler(Scheduler):
    def __init__(self, name: str, pool: WorkerPool, config: Any, stats: ModelStats) -> None:
        super().__init__(name, pool, config, stats)
        self._prefetch = False  # requests wait in their slots and sequences, not at an instance
        self._instances = len(pool.workers)
        # slot s belongs to instance s % instances
        self._slots: list[Job | None] = [None] * (self._instances * max(1, config.max_batch_size))
        self._backlog: deque[Job] = deque()
        self._executing: set[int] = set()  # id() of the jobs in an execute now
        self._stopped = False

    # -- a request's way in ----------------------------------------------------------------
    async def _run(self, job: Job) -> WorkerReply | None:
        if self._stopped:
            raise errors.UnavailableError(f"model '{self.name}' is being unloaded")
        if not self._any_live():
            raise errors.UnavailableError(
                f"no instance of model '{self.name}' is available (restarting)"
            )
        self._bind(job)
        self.dispatch()
        try:
            return await job.future
        except asyncio.CancelledError:
            if id(job) in self._executing and job.sent is not None:
                job.sent[0].cancel(job.sent[1])  # the model sees is_cancelled(); not rerun
            else:
                self._leave(job)
                self.dispatch()
            raise

    def _bind(self, job: Job) -> None:
        """A free slot for ``job`` (on the least loaded instance), else the backlog."""
        free = [slot for slot, held in enumerate(self._slots) if held is None]
        if not free:
            self._backlog.append(job)
            self.stats.pending = self._waiting()
            return
        count = self._instances
        load = Counter(slot % count for slot, held in enumerate(self._slots) if held is not None)
        slot = min(free, key=lambda s: (load[s % count], s))
        self._slots[slot] = job

    def _leave(self, job: Job) -> None:
        """``job`` is done (or gone): its slot goes to the oldest request in the backlog."""
        if job in self._backlog:
            self._backlog.remove(job)
        elif job in self._slots:
            self._slots[self._slots.index(job)] = None
            if self._backlog:
                self._bind(self._backlog.popleft())
        self.stats.pending = self._waiting()

    # -- dispatch --------------------------------------------------------------------------
    def dispatch(self) -> None:
        """Each free instance executes every request in its slots."""
        for index, worker in enumerate(self.pool.workers):
            if worker is None or not worker.alive or worker in self._busy:
                continue
            jobs = [
                job for job in self._slots[index :: self._instances]
                if job is not None and id(job) not in self._executing
            ]  # fmt: skip
            if jobs:
                self._send(worker, jobs)
        if self._waiting() and not self._any_live():
            self._fail_all(
                errors.UnavailableError(
                    f"no instance of model '{self.name}' is available (restarting)"
                )
            )
        self.stats.pending = self._waiting()
        idle = self._idle
        if not self._waiting() and not self._busy and idle is not None and not idle.done():
            idle.set_result(None)

    def _send(self, worker: WorkerHandle, jobs: list[Job]) -> None:
        live = [job for job in jobs if self._still_wanted(job, worker)]
        if not live:
            return
        execution = Execution(worker, len(live), sum(max(j.batch, 1) for j in live))
        callbacks: list[ReplyCallback] = []
        for job in live:
            on_reply = self._on_reply if job.sink is None else self._on_stream_end
            callbacks.append(functools.partial(on_reply, execution, job))
        again = [job.sent[1] if job.sent is not None else None for job in live]
        try:
            rids = worker.submit([job.item for job in live], callbacks, rids=again)
        except errors.DlserveError as exc:
            for job in live:
                self._end(job, exc)
            return
        for job, rid in zip(live, rids, strict=True):
            first = job.sent is None
            job.sent = (worker, rid)
            self._executing.add(id(job))
            if job.sink is not None:  # decoupled: its responses stream from the first send
                sink = job.sink
                sink.freed = sink.executed = False
                sink.on_free = functools.partial(self._on_stream_free, execution, job)
                sink.on_executed = functools.partial(self._record_execution, execution)
                worker.attach_stream(rid, sink)
                if first:
                    job.future.set_result(None)
        self._busy.add(worker)

    def _still_wanted(self, job: Job, worker: WorkerHandle) -> bool:
        """Whether a request in a slot is to run (again) on ``worker``: not if its client
        went away while it waited, nor if the instance that ran it before has died since
        (what the model kept of it died too)."""
        sink = job.sink
        if job.sent is None:
            return not job.future.done()
        if (sink is None and job.future.done()) or (sink is not None and sink.abandoned):
            self._drop(job)
            return False
        if job.sent[0] is not worker:
            self._end(job, errors.WorkerDiedError(
                f"model instance '{job.sent[0].label}' exited while the request was between "
                "two of its executions"
            ))  # fmt: skip
            return False
        return True

    # -- answers ---------------------------------------------------------------------------
    def _on_reply(self, execution: Execution, job: Job, outcome: Outcome) -> None:
        self._executing.discard(id(job))
        if isinstance(outcome, WorkerReply) and outcome.rescheduled:
            self.stats.inference_count += max(job.batch, 1)  # each execute's, as Triton counts
            if outcome.timings is not None:
                self._record_execution(execution, outcome.timings)
            if job.future.done():  # its client went away during this execute
                self._drop(job)
            self._executed(execution)
        else:
            self._leave(job)  # its slot goes to the backlog before the instance is free
            super()._on_reply(execution, job, outcome)  # the reply; frees the instance

    def _on_stream_free(self, execution: Execution, job: Job) -> None:
        """A decoupled request's execute returned (rescheduled or not), or it ended."""
        self._executing.discard(id(job))
        sink = job.sink
        assert sink is not None
        if sink.rescheduled and not sink.finished:
            self.stats.inference_count += max(job.batch, 1)  # as for a non-decoupled one
        if sink.rescheduled and sink.abandoned and not sink.finished:
            self._drop(job)  # its consumer left: it is not run again
        elif not sink.rescheduled or sink.finished:
            self._leave(job)
        self._executed(execution)

    def _drop(self, job: Job) -> None:
        """A rescheduled request that will not run again, between two executes: its slot,
        and the input memory kept for it."""
        self._leave(job)
        if job.sent is not None:
            job.sent[0].forget(job.sent[1])

    def _executed(self, execution: Execution) -> None:
        execution.remaining -= 1
        if execution.remaining == 0:
            self._busy.discard(execution.worker)
            self.dispatch()

    def _end(self, job: Job, exc: errors.DlserveError) -> None:
        """Fail a request that is not executing (new, or between two executes)."""
        if job.sink is not None:
            job.sink.end(exc)
        else:
            fail_job(job, exc)
        self._drop(job)

    # -- queue state, unload ---------------------------------------------------------------
    def _waiting(self) -> int:
        waiting = sum(1 for j in self._slots if j is not None and id(j) not in self._executing)
        return waiting + len(self._backlog)

    def _fail_all(self, failure: errors.DlserveError) -> None:
        for job in [*self._slots, *self._backlog]:
            if job is not None and id(job) not in self._executing:
                self._end(job, failure)

    def stop(self) -> None:
        """The version goes away: what waits (new or between two executes) fails."""
        super().stop()
        self._stopped = True
        self._fail_all(errors.UnavailableError(f"model '{self.name}' is being unloaded"))
