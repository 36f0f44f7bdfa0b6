"""The executions in flight on a model's instances: which instances are busy, and which request
waits at a busy instance behind the one it runs (server/core/scheduling/scheduler.py says when)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dlserve.server.core.instances.handle import WorkerHandle
from dlserve.server.core.scheduling.queues import Job


@dataclass(slots=True, eq=False)  # compared and hashed by identity
class Execution:
    """One execute() call sent to one worker."""

    worker: WorkerHandle
    remaining: int  # replies still to come
    batch_size: int  # inferences in all
    recorded: bool = False
    ahead: Execution | None = None  # in flight on the worker when this one was sent
    answered: bool = False  # the worker replied: its execute returned
    jobs: Sequence[Job] = ()

    def was_waiting(self) -> bool:
        """Whether it was still waiting in its worker's socket: the one ahead of it had not
        answered (asked when the worker died)."""
        return self.ahead is not None and not self.ahead.answered


class InFlight:
    """The scheduler's instances and their executions."""

    def __init__(self) -> None:
        self.busy: set[WorkerHandle] = set()  # instances with an execution in flight
        self.waiting: set[Execution] = set()  # sent, behind another execute not returned
        self._count: dict[WorkerHandle, int] = {}  # executions in flight, per busy instance
        self._newest: dict[WorkerHandle, Execution] = {}  # the last sent, per busy instance

    def has_one(self, worker: WorkerHandle) -> bool:
        """Busy with one execution, nothing waiting behind it."""
        return self._count.get(worker) == 1

    def prepare(self, worker: WorkerHandle, jobs: list[Job]) -> Execution:
        """An execution of ``jobs`` on ``worker``, behind the one it runs (if any); it is
        in flight once :meth:`sent` says so."""
        return Execution(worker, len(jobs), 0, ahead=self._newest.get(worker), jobs=jobs)

    def sent(self, execution: Execution) -> None:
        """The worker has ``execution`` (its frame went out)."""
        worker, ahead = execution.worker, execution.ahead
        if ahead is not None:  # it runs now: nothing waits before it any more
            ahead.ahead = None
        self.busy.add(worker)
        self._count[worker] = self._count.get(worker, 0) + 1
        self._newest[worker] = execution
        if ahead is not None and not ahead.answered:
            self.waiting.add(execution)

    def answered(self, execution: Execution) -> bool:
        """A reply of ``execution`` came: its execute returned, the one behind it starts.
        Whether one was waiting behind it."""
        if execution.answered:
            return False
        execution.answered = True
        return self._behind_starts(execution)

    def _behind_starts(self, execution: Execution) -> bool:
        behind = self._newest.get(execution.worker)
        if behind is not None and behind.ahead is execution and behind in self.waiting:
            self.waiting.discard(behind)
            return True
        return False

    def done(self, execution: Execution) -> None:
        """``execution`` has all its replies (or failures): its instance may take more."""
        worker = execution.worker
        self.waiting.discard(execution)
        self._behind_starts(execution)  # also when it failed: nothing holds that one now
        count = self._count.pop(worker, 1) - 1
        if count > 0:
            self._count[worker] = count
        else:
            self._newest.pop(worker, None)
            self.busy.discard(worker)

    def cancelled(self, job: Job) -> None:
        """A job waiting at an instance was cancelled: it will not run (the worker answers
        it unrun), so it no longer waits."""
        for execution in self.waiting:
            if job in execution.jobs:
                self.waiting.discard(execution)
                return
