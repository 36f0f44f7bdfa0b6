"""One model version's scheduler: requests wait here until an instance is free.

Every instance runs one ``execute`` at a time, as in Triton. With ``dynamic_batching`` one execute
gets several requests (:mod:`dlserve.server.core.scheduling.queues` decides which), and a request
is sent to a worker only when the worker has answered everything it was given, so requests queue in
the server, where priorities, timeouts and the batcher act on them.

Without it (and not decoupled) a model has none of those, and when a request can run on one
instance only (the model has one, or one on the GPU its CUDA input is on) one more request
may wait at that instance while it is busy, in its socket: the worker starts it as soon as
its ``execute`` returns, without waiting for the server to read the reply and send the
next one (the server and the worker work at the same time; on 2 vCPUs 8 clients got 4-36 %
more requests through one instance, docs/benchmarks.md). With several instances to choose
from, requests wait here, so that whichever instance frees first takes the next. A request
waiting at an instance is still the server's: a client that leaves cancels it (the worker
answers it without running it), and if the instance dies before it started it goes back to
the head of the queue, as if it had never left.

An instance is free again when its ``execute`` returns, which its worker's reply says; a
model that is not decoupled may send a request's response after that (its reply is then a
``deferred`` notice, and the response follows), and a decoupled model's ``async def
execute`` returns, for the scheduler, as soon as the worker has started it.

Nothing here runs in a task of its own: requests are dispatched when one arrives, when
an instance answers, when an instance restarts, and on a timer for queue delays and
timeouts.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable
from typing import Any, cast

from dlserve import errors
from dlserve.ipc import messages as m
from dlserve.server.core.instances.decoupled_replies import StreamSink
from dlserve.server.core.instances.handle import WorkerHandle, WorkItem
from dlserve.server.core.instances.pending import ReplyCallback
from dlserve.server.core.instances.placement import NO_SPANS
from dlserve.server.core.instances.pool import WorkerPool
from dlserve.server.core.instances.replies import Outcome, WorkerReply
from dlserve.server.core.scheduling.executions import Execution, InFlight
from dlserve.server.core.scheduling.queues import TIMEOUT_EXPIRED, BatchPolicy, Job, JobQueue
from dlserve.server.core.scheduling.sequence_config import (
    SEQUENCE_END,
    SEQUENCE_ID,
    SEQUENCE_START,
    pop_sequence,
)
from dlserve.server.core.shm.registry import RegionLease
from dlserve.server.core.telemetry.stats import ModelStats
from dlserve.types import InputTensor, Parameters

log = logging.getLogger("dlserve.scheduler")

# Request parameters the scheduler consumes (Triton's); the model does not see them (the
# sequence ones reach it as request.correlation_id() and request.flags()).
PRIORITY = "priority"
TIMEOUT = "timeout"
_CONSUMED = frozenset((PRIORITY, TIMEOUT, SEQUENCE_ID, SEQUENCE_START, SEQUENCE_END))


class Scheduler:
    def __init__(self, name: str, pool: WorkerPool, config: Any, stats: ModelStats) -> None:
        self.name = name
        self.pool = pool
        self.policy = BatchPolicy.from_config(config)
        self.queue = JobQueue(self.policy)
        self.stats = stats
        self._flight = InFlight()
        self._busy = self._flight.busy  # instances with an execution in flight
        # one request may wait at a busy instance (module docstring): nothing to batch,
        # prioritize or time out; an instance of a decoupled model is busy until its
        # execute returns, which only its notice says
        self._prefetch = not self.policy.dynamic and not config.model_transaction_policy.decoupled
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0
        self._idle: asyncio.Future[None] | None = None  # drain() waits on it
        self._deferred = 0  # requests whose execute returned, their responses still to come
        self._warned_cross_device = False
        # a request alone may go straight to a free instance (no queue delay to wait)
        self._direct = self.policy.delay_ns == 0
        policies = [self.policy.default_policy, *self.policy.level_policies.values()]
        self._timed = any(p.default_timeout_ns or p.allow_override for p in policies)
        pool.on_restart = self.dispatch
        self._loop = asyncio.get_running_loop()  # asked once: each ask costs a getpid()

    def job(
        self,
        request_id: str,
        inputs: list[InputTensor],
        outputs: list[str],
        parameters: Parameters,
        batch: int,
        lease: RegionLease | None = None,
        *,
        keep: bool = False,
        chain: list[str] | None = None,
        lend: bool = False,
    ) -> Job:
        """A request made ready to queue (its priority and timeout read, then dropped).
        ``chain`` and ``lend``: a BLS request's upstream models, and whether its outputs
        stay in the worker's memory for the caller to map."""
        params = parameters
        priority = timeout_us = flags = 0
        correlation_id: int | str = 0
        if parameters and not _CONSUMED.isdisjoint(parameters):  # the core's, not the model's
            params = dict(parameters)
            priority = _int_param(params.pop(PRIORITY, 0), PRIORITY)
            timeout_us = _int_param(params.pop(TIMEOUT, 0), TIMEOUT)
            correlation_id, flags = pop_sequence(params)
        level = self.policy.level(priority) if priority else self.policy.default_level
        now = time.monotonic_ns()
        deadline = self.policy.policy(level).deadline(now, timeout_us) if self._timed else 0
        item = WorkItem(
            request_id, inputs, outputs, params,
            lease.inputs if lease is not None else NO_SPANS,
            lease.outputs if lease is not None else NO_SPANS, chain or [], lend,
            correlation_id, flags, timeout_us=timeout_us, keep=keep,
        )  # fmt: skip
        future: asyncio.Future[WorkerReply | None] = self._loop.create_future()
        return Job(item, batch, level, now, deadline, future, lease)

    def run(self, job: Job) -> Awaitable[WorkerReply]:
        """Queue ``job`` and wait for its reply. A caller that is cancelled (its client
        went away) takes its job out of the queue; a job already executing runs on."""
        # no coroutine of its own: a job without a sink always gets a reply, never None
        return cast(Awaitable[WorkerReply], self._run(job))

    async def run_stream(self, job: Job, sink: StreamSink) -> tuple[WorkerHandle, int]:
        """Queue a decoupled model's ``job`` and wait until it is sent: its responses go to
        ``sink`` from then on, and the instance is busy until its ``execute`` returns. Where
        it was sent (to cancel it)."""
        job.sink = sink
        await self._run(job)
        assert job.sent is not None
        return job.sent

    async def _run(self, job: Job) -> WorkerReply | None:
        worker = None
        if self._direct and not len(self.queue) and not _expired(job):
            worker = self._free_worker(job.device, job.item.chain)
        if worker is not None:
            self._send(worker, [job])  # the fast path: nothing waits, an instance is free
        else:
            if not self._any_live():
                raise errors.UnavailableError(
                    f"no instance of model '{self.name}' is available (restarting)"
                )
            self.queue.push(job)
            self._update_pending()
            self.dispatch()
        try:
            return await job.future
        except asyncio.CancelledError:
            if self.queue.remove(job):
                self._update_pending()
            elif job.sent is not None:  # executing (or waiting at its instance): the model
                self._flight.cancelled(job)  # sees is_cancelled() (or it is answered unrun)
                self._update_pending()
                job.sent[0].cancel(job.sent[1])
            raise

    # -- dispatch -----------------------------------------------------------------------
    def dispatch(self) -> None:
        """Send what can go now to free instances; wake up later for what must wait."""
        if not len(self.queue):
            if self._is_idle() and self._idle is not None and not self._idle.done():
                self._idle.set_result(None)
            return
        now = time.monotonic_ns()
        for job in self.queue.expire(now):
            fail_job(job, errors.UnavailableError(TIMEOUT_EXPIRED))
        wait = 0
        while (head := self.queue.head()) is not None:
            worker = self._free_worker(head.device, head.item.chain)
            if worker is None:
                if not self._any_live():  # every instance is down: nothing would run these
                    failure = errors.UnavailableError(
                        f"no instance of model '{self.name}' is available (restarting)"
                    )
                    for job in self.queue.all():
                        fail_job(job, failure)
                break
            count, wait = self.queue.next_batch(now)
            if not count:
                break
            self._send(worker, self.queue.take(count))
        self._update_pending()
        if len(self.queue):
            self._wake_up(now, wait)
        elif self._is_idle() and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def _is_idle(self) -> bool:
        """Nothing executing, and no response still to come from a returned execute."""
        return not self._busy and not self._deferred

    def _any_live(self) -> bool:
        return any(w is not None and w.alive for w in self.pool.workers)

    def _free_worker(self, device: int | None, chain: list[str]) -> WorkerHandle | None:
        """A free instance for a batch whose head request has its CUDA input on GPU
        ``device``: one on that GPU when the model has any there (waiting for it if they
        are busy), else any (the request crosses devices: said once, and counted). Never
        one in the head's BLS call ``chain``: it waits for that request (it may look free
        here when it runs a call sent to it directly by another worker)."""
        if device is not None:
            on_device = self.pool.on_device(device)
            if chain:
                on_device = [w for w in on_device if not self.pool.upstream(w, chain)]
            if on_device:
                free = next((w for w in on_device if w not in self._busy), None)
                return free if free is not None or len(on_device) > 1 else self._sole(on_device[0])
        workers = self.pool.workers
        for worker in workers:
            if (
                worker is not None and worker.alive and worker not in self._busy
                and (not chain or not self.pool.upstream(worker, chain))
            ):  # fmt: skip
                return worker
        sole = workers[0] if len(workers) == 1 else None
        if sole is not None and not (chain and self.pool.upstream(sole, chain)):
            return self._sole(sole)
        return None

    def _sole(self, worker: WorkerHandle | None) -> WorkerHandle | None:
        """The model's one instance (or the one on the request's GPU), busy: the request
        waits there rather than here when nothing waits there yet. With several instances
        it waits here, so that whichever frees first takes it."""
        if worker is not None and worker.alive and self._prefetch and self._flight.has_one(worker):
            return worker
        return None

    def _count_crossings(self, worker: WorkerHandle, jobs: list[Job]) -> None:
        devices = [job.device for job in jobs if job.device is not None]
        if not devices:
            return
        gpu = self.pool.gpu_of(worker)
        for device in devices:
            if device != gpu:
                self._crossed(device)

    def _crossed(self, device: int) -> None:
        self.stats.cross_device += 1
        if not self._warned_cross_device:
            self._warned_cross_device = True
            log.warning(
                "model '%s' has no instance on GPU %s, where a request's CUDA input is: it "
                "is served across devices (counted in dlserve_cross_device_requests_total; "
                "said once)", self.name, device,
            )  # fmt: skip

    def _wake_up(self, now: int, wait: int) -> None:
        """Dispatch again after ``wait`` ns (a batch's queue delay) or at the next timeout."""
        at = now + wait if wait else 0
        deadline = self.queue.next_deadline()
        if deadline and (not at or deadline < at):
            at = deadline + 1000
        if not at or (self._timer is not None and self._timer_at <= at):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        delay = max(at - time.monotonic_ns(), 0) / 1e9
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.dispatch()

    def _send(self, worker: WorkerHandle, jobs: list[Job]) -> None:
        live = [job for job in jobs if not job.future.done()]
        if not live:
            return
        execution = self._flight.prepare(worker, live)
        callbacks: list[ReplyCallback] = []
        for job in live:
            execution.batch_size += job.batch if job.batch > 1 else 1
            if job.lease is not None:
                job.lease.bind(worker)
                if job.lease.device is not None:
                    self._count_crossings(worker, [job])
            on_reply = self._on_reply if job.sink is None else self._on_stream_end
            callbacks.append(functools.partial(on_reply, execution, job))
        try:
            rids = worker.submit([job.item for job in live], callbacks, notices=True)
        except errors.DlserveError as exc:
            for job in live:
                fail_job(job, exc)
            return
        self._flight.sent(execution)
        for job, rid in zip(live, rids, strict=True):
            job.sent = (worker, rid)
            if job.sink is not None:  # decoupled: its responses stream from now on
                job.sink.on_free = functools.partial(self._on_free, execution)
                job.sink.on_executed = functools.partial(self._record_execution, execution)
                worker.attach_stream(rid, job.sink)
                job.future.set_result(None)
        if execution.ahead is not None:  # it waits at the instance: still pending
            self._update_pending()

    def _on_stream_end(self, execution: Execution, job: Job, outcome: Outcome) -> None:
        """A decoupled request that ended without its final response: its worker died, or
        it was cancelled before it started (then the worker answers it once)."""
        assert job.sink is not None
        if isinstance(outcome, WorkerReply):
            ended = "the request ended without a response"  # answered unrun: cancelled
            job.sink.end(outcome.error or errors.error_from_worker(ended, ""))
        else:
            job.sink.end(outcome)

    def _on_free(self, execution: Execution) -> None:
        """One of a decoupled execution's requests is done with its instance: ``execute``
        returned, or the request ended first."""
        execution.remaining -= 1
        if execution.remaining == 0:
            self._flight.done(execution)
            self.dispatch()

    def _on_reply(self, execution: Execution, job: Job, outcome: Outcome) -> None:
        """A request's reply, its failure, or the notice that its execute returned without
        its response (``deferred``: the model sends it later, and the instance is free)."""
        if isinstance(outcome, WorkerReply):
            if not job.returned:  # the reply says that the execute returned
                if not execution.answered and self._flight.answered(execution):
                    self._update_pending()  # the one waiting behind it starts
                if outcome.timings is not None:
                    self._record_execution(execution, outcome.timings)
            if outcome.deferred:
                job.returned = True
                self._deferred += 1
                self._returned(execution)
                return
            if job.future.done():  # its client went away meanwhile
                execution.worker.discard(outcome)
            elif outcome.error is not None:
                job.future.set_exception(outcome.error)
            else:
                job.future.set_result(outcome)
        elif isinstance(outcome, errors.WorkerDiedError) and execution.was_waiting():
            self._flight.waiting.discard(execution)
            self._requeue(job)  # it never started: another instance (or the restart) runs it
        else:
            fail_job(job, outcome)
        if job.returned:  # a deferred response: its instance was free already
            self._deferred -= 1
            if not self._deferred:
                self.dispatch()  # drain() may be waiting for it
            return
        self._returned(execution)

    def _returned(self, execution: Execution) -> None:
        """One of ``execution``'s requests is done with its instance."""
        execution.remaining -= 1
        if execution.remaining == 0:
            self._flight.done(execution)
            self.dispatch()

    def _requeue(self, job: Job) -> None:
        job.sent = None
        self.queue.push_front(job)
        self._update_pending()

    def _update_pending(self) -> None:
        """Triton's pending count: requests awaiting execution, in the queue or at an
        instance behind another execute."""
        self.stats.pending = len(self.queue) + len(self._flight.waiting)

    def _record_execution(self, execution: Execution, t: m.Timings) -> None:
        if execution.recorded:
            return
        execution.recorded = True
        self.stats.record_execution(
            execution.batch_size,
            t.infer_start - t.input_start,
            t.infer_end - t.infer_start,
            t.output_end - t.infer_end,
        )

    async def drain(self, timeout: float) -> None:
        """Wait (up to ``timeout`` s) until nothing is queued or executing: a version being
        unloaded takes no new requests, and finishes the ones it has."""
        deadline = time.monotonic() + timeout
        while (self._waiting() or not self._is_idle()) and time.monotonic() < deadline:
            self._idle = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(self._idle, deadline - time.monotonic())
            except TimeoutError:
                break

    def _waiting(self) -> int:
        """How many requests wait for an instance."""
        return len(self.queue)

    def stop(self) -> None:
        """The version goes away: what still waits fails."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        failure = errors.UnavailableError(f"model '{self.name}' is being unloaded")
        for job in self.queue.all():
            fail_job(job, failure)
        self.stats.pending = 0


def _expired(job: Job) -> bool:
    """Whether ``job``'s timeout passed before it could be sent (a timeout of a few
    microseconds): it goes through the queue, whose policy acts on it (REJECT refuses it,
    DELAY puts it behind the others), as Triton's batcher does."""
    return 0 < job.deadline_ns < time.monotonic_ns()


def fail_job(job: Job, exc: errors.DlserveError) -> None:
    """End a job that waits (or ran) with ``exc``, unless it has its outcome already."""
    if not job.future.done():
        job.future.set_exception(exc)


def _int_param(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise errors.InvalidArgumentError(f"parameter '{name}' must be an integer")
    return value
