"""A model's request queue: priority levels, queue policies, and how batches are formed.

This is Triton's dynamic batcher as dlserve reproduces it (``dynamic_batching`` in the
config):

- Priority levels are numbered from 1 (the highest); a request's ``priority`` parameter
  picks one, 0 or a level out of range means ``default_priority_level``. Each level is
  FIFO and has its own queue policy (``priority_queue_policy``, else the default one).
- A policy's ``max_queue_size`` bounds its level: one more request is refused with
  UNAVAILABLE "Exceeds maximum queue size".
- A request has a timeout: the policy's ``default_timeout_microseconds``, or the request's
  own ``timeout`` parameter where ``allow_timeout_override`` lets it be shorter. Past it, a
  queued request is refused (REJECT: UNAVAILABLE "Request timeout expired") or moved
  behind the level's unexpired requests (DELAY).
- A batch is the queue's head, in priority order, up to ``max_batch_size`` in all (each
  request counts its first dimension). A batch that reaches a preferred size goes at
  once; otherwise the scheduler waits up to ``max_queue_delay_microseconds`` from the
  oldest request for more, then sends the largest preferred size it has, or all it has.

A model without dynamic batching has one FIFO level and no policy: one request per batch.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from dlserve import errors
from dlserve.server.core.instances.decoupled_replies import StreamSink
from dlserve.server.core.instances.handle import WorkerHandle, WorkItem
from dlserve.server.core.instances.replies import WorkerReply
from dlserve.server.core.shm.registry import RegionLease

QUEUE_FULL = "Exceeds maximum queue size"
TIMEOUT_EXPIRED = "Request timeout expired"


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    max_queue_size: int = 0  # 0: unbounded
    reject: bool = True  # timeout_action REJECT; False: DELAY
    default_timeout_ns: int = 0  # 0: none
    allow_override: bool = False

    @classmethod
    def from_proto(cls, policy: Any) -> QueuePolicy:
        return cls(
            int(policy.max_queue_size),
            policy.timeout_action != mc.ModelQueuePolicy.DELAY,
            int(policy.default_timeout_microseconds) * 1000,
            bool(policy.allow_timeout_override),
        )

    def deadline(self, now_ns: int, requested_us: int) -> int:
        """When a request queued now times out (0: never); ``requested_us`` is its own
        ``timeout`` parameter, honoured where the policy lets it shorten the default."""
        timeout = self.default_timeout_ns
        requested = requested_us * 1000
        if self.allow_override and requested > 0 and (timeout == 0 or requested < timeout):
            timeout = requested
        return now_ns + timeout if timeout else 0


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    """How a model's scheduler queues and groups requests, from its config."""

    dynamic: bool = False
    max_batch_size: int = 1  # inferences per execute (at least 1)
    preferred: frozenset[int] = frozenset()
    max_preferred: int = 1
    delay_ns: int = 0
    levels: int = 0
    default_level: int = 0
    default_policy: QueuePolicy = QueuePolicy()
    level_policies: dict[int, QueuePolicy] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config: Any) -> BatchPolicy:
        if not config.HasField("dynamic_batching"):
            return cls()
        dynamic = config.dynamic_batching
        max_batch = max(int(config.max_batch_size), 1)
        preferred = frozenset(int(p) for p in dynamic.preferred_batch_size)
        levels = int(dynamic.priority_levels)
        return cls(
            dynamic=True,
            max_batch_size=max_batch,
            preferred=preferred,
            max_preferred=max(preferred) if preferred else max_batch,
            delay_ns=int(dynamic.max_queue_delay_microseconds) * 1000,
            levels=levels,
            default_level=int(dynamic.default_priority_level) if levels else 0,
            default_policy=QueuePolicy.from_proto(dynamic.default_queue_policy),
            level_policies={
                int(level): QueuePolicy.from_proto(policy)
                for level, policy in dynamic.priority_queue_policy.items()
            },
        )

    def level(self, priority: int) -> int:
        """The level a request's ``priority`` parameter puts it at."""
        if self.levels == 0 or priority <= 0 or priority > self.levels:
            return self.default_level
        return priority

    def policy(self, level: int) -> QueuePolicy:
        return self.level_policies.get(level, self.default_policy)


@dataclass(eq=False, slots=True)
class Job:
    """One request waiting for (or in) an execution."""

    item: WorkItem
    batch: int  # the request's batch size (1 for a model without batching)
    level: int
    enqueued_ns: int
    deadline_ns: int  # 0: no timeout
    future: asyncio.Future[WorkerReply | None]  # None: a decoupled request was sent
    lease: RegionLease | None = None
    delayed: bool = False  # timed out under DELAY: moved behind its level's others
    sent: tuple[WorkerHandle, int] | None = None  # the worker and rid it went to
    sink: StreamSink | None = None  # a decoupled request's: where its responses go
    returned: bool = False  # its execute returned without its response (deferred)

    @property
    def device(self) -> int | None:
        """The GPU of the request's CUDA input, if it has one."""
        return self.lease.device if self.lease is not None else None


@dataclass(slots=True)
class _Level:
    policy: QueuePolicy
    queue: deque[Job] = field(default_factory=deque)
    delayed: deque[Job] = field(default_factory=deque)  # timed out under DELAY

    def __len__(self) -> int:
        return len(self.queue) + len(self.delayed)


class JobQueue:
    def __init__(self, policy: BatchPolicy) -> None:
        self.policy = policy
        self._levels: dict[int, _Level] = {}
        self._size = 0
        self._timed = 0  # queued jobs that have a deadline (none: nothing to expire)

    def __len__(self) -> int:
        return self._size

    def push(self, job: Job) -> None:
        """Queue ``job`` at its level; raises UnavailableError when the level is full."""
        level = self._levels.get(job.level)
        if level is None:
            level = self._levels[job.level] = _Level(self.policy.policy(job.level))
            self._levels = dict(sorted(self._levels.items()))  # highest priority first
        limit = level.policy.max_queue_size
        if limit and len(level) >= limit:
            raise errors.UnavailableError(QUEUE_FULL)
        level.queue.append(job)
        self._size += 1
        self._timed += job.deadline_ns != 0

    def push_front(self, job: Job) -> None:
        """Put ``job`` back at the head of its level (sent to an instance that died before
        it started): it was admitted already, so no queue limit applies."""
        level = self._levels.get(job.level)
        if level is None:
            level = self._levels[job.level] = _Level(self.policy.policy(job.level))
            self._levels = dict(sorted(self._levels.items()))
        level.queue.appendleft(job)
        self._size += 1
        self._timed += job.deadline_ns != 0

    def remove(self, job: Job) -> bool:
        """Take a job out (its client went away); False when it is not queued."""
        level = self._levels.get(job.level)
        if level is None:
            return False
        for jobs in (level.queue, level.delayed):
            try:
                jobs.remove(job)
            except ValueError:
                continue
            self._size -= 1
            self._timed -= job.deadline_ns != 0 and not job.delayed
            return True
        return False

    def expire(self, now_ns: int) -> list[Job]:
        """Apply the timeouts: DELAY moves a job back, REJECT returns it to be refused."""
        rejected: list[Job] = []
        if not self._timed:
            return rejected
        for level in self._levels.values():
            if not level.queue or not any(0 < j.deadline_ns < now_ns for j in level.queue):
                continue
            kept: deque[Job] = deque()
            for job in level.queue:
                if not 0 < job.deadline_ns < now_ns:
                    kept.append(job)
                elif level.policy.reject:
                    rejected.append(job)
                    self._timed -= 1
                else:
                    job.delayed = True
                    level.delayed.append(job)
                    self._timed -= 1  # delayed jobs do not time out again
            level.queue = kept
        self._size -= len(rejected)
        return rejected

    def next_deadline(self) -> int:
        """The closest timeout among queued jobs that can still time out (0: none)."""
        if not self._timed:
            return 0
        deadlines = [j.deadline_ns for lv in self._levels.values() for j in lv.queue]
        return min((d for d in deadlines if d), default=0)

    def head(self) -> Job | None:
        return next(self.ordered(), None)

    def ordered(self) -> Iterator[Job]:
        for level in self._levels.values():
            yield from level.queue
            yield from level.delayed

    def take(self, count: int) -> list[Job]:
        """The first ``count`` jobs in priority order, out of the queue."""
        taken: list[Job] = []
        for level in self._levels.values():
            for jobs in (level.queue, level.delayed):
                while jobs and len(taken) < count:
                    taken.append(jobs.popleft())
        self._size -= len(taken)
        self._timed -= sum(j.deadline_ns != 0 and not j.delayed for j in taken)
        return taken

    def all(self) -> list[Job]:
        """Every queued job, out of the queue."""
        return self.take(self._size)

    def next_batch(self, now_ns: int) -> tuple[int, int]:
        """How many jobs from the head make the next batch, or (0, ns to wait for more)."""
        policy = self.policy
        if not policy.dynamic:
            return (1 if self._size else 0), 0
        pending = count = best = 0
        oldest = now_ns
        full = False
        for job in self.ordered():
            size = max(job.batch, 1)
            if count:
                if pending + size > policy.max_preferred and not best:
                    best = count
                if pending + size > policy.max_batch_size:
                    full = True
                    break
            pending += size
            count += 1
            oldest = min(oldest, job.enqueued_ns)
            if pending in policy.preferred:
                best = count
        waited = now_ns - oldest
        delay_exceeded = policy.delay_ns != 0 and waited >= policy.delay_ns
        if best and not delay_exceeded:
            return best, 0
        if full or pending >= policy.max_preferred or delay_exceeded or not policy.delay_ns:
            return count, 0
        return 0, policy.delay_ns - waited
