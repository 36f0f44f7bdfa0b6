"""The scheduler's queue on its own: batch forming, priority levels, queue policies."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from dlserve import errors
from dlserve.server.core.instances.handle import WorkItem
from dlserve.server.core.scheduling.queues import BatchPolicy, Job, JobQueue, QueuePolicy

MS = 1_000_000


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    running = asyncio.new_event_loop()
    yield running
    running.close()


def policy(text: str, max_batch_size: int = 8) -> BatchPolicy:
    config = text_format.Parse(f"max_batch_size: {max_batch_size}\n{text}", mc.ModelConfig())
    return BatchPolicy.from_config(config)


def job(
    loop: asyncio.AbstractEventLoop, batch: int = 1, at: int = 0, level: int = 0, deadline: int = 0
) -> Job:
    return Job(WorkItem("", [], [], {}), batch, level, at, deadline, loop.create_future())


def test_without_dynamic_batching_one_request_per_batch(loop: asyncio.AbstractEventLoop) -> None:
    queue = JobQueue(policy(""))
    assert queue.next_batch(0) == (0, 0)
    for _ in range(3):
        queue.push(job(loop))
    assert queue.next_batch(0) == (1, 0)


def test_no_delay_sends_everything_up_to_max_batch_size(loop: asyncio.AbstractEventLoop) -> None:
    queue = JobQueue(policy("dynamic_batching { }"))
    for size in (3, 4, 2):  # 3 + 4 fit in 8; 2 more would not
        queue.push(job(loop, size))
    assert queue.next_batch(0) == (2, 0)
    assert [j.batch for j in queue.take(2)] == [3, 4]
    assert queue.next_batch(0) == (1, 0)


def test_the_queue_delay_waits_for_more_then_sends(loop: asyncio.AbstractEventLoop) -> None:
    queue = JobQueue(policy("dynamic_batching { max_queue_delay_microseconds: 10000 }"))
    queue.push(job(loop, 1, at=0))
    assert queue.next_batch(4 * MS) == (0, 6 * MS)  # 6 ms left of the 10 ms delay
    queue.push(job(loop, 1, at=5 * MS))
    assert queue.next_batch(10 * MS) == (2, 0)  # the oldest has waited long enough


def test_a_full_batch_goes_without_waiting(loop: asyncio.AbstractEventLoop) -> None:
    queue = JobQueue(policy("dynamic_batching { max_queue_delay_microseconds: 10000000 }"))
    queue.push(job(loop, 5))
    queue.push(job(loop, 3))
    assert queue.next_batch(0) == (2, 0)


def test_preferred_sizes(loop: asyncio.AbstractEventLoop) -> None:
    text = "dynamic_batching { preferred_batch_size: [2, 4] max_queue_delay_microseconds: 1000 }"
    queue = JobQueue(policy(text))
    queue.push(job(loop, 1))
    assert queue.next_batch(0) == (0, MS)  # 1 is not preferred: wait
    for _ in range(4):
        queue.push(job(loop, 1))
    assert queue.next_batch(0) == (4, 0)  # the largest preferred size in reach
    assert queue.next_batch(2 * MS) == (5, 0)  # past the delay: all that fits


def test_levels_and_their_policies(loop: asyncio.AbstractEventLoop) -> None:
    batching = policy(
        "dynamic_batching { priority_levels: 3 default_priority_level: 2 "
        "default_queue_policy { max_queue_size: 1 } "
        "priority_queue_policy { key: 1 value { max_queue_size: 2 } } }"
    )
    assert [batching.level(p) for p in (0, 1, 2, 3, 4)] == [2, 1, 2, 3, 2]
    queue = JobQueue(batching)
    low, high = job(loop, 1, level=2), job(loop, 1, level=1)
    queue.push(low)
    with pytest.raises(errors.UnavailableError, match=r"^Exceeds maximum queue size$"):
        queue.push(job(loop, 1, level=2))
    queue.push(high)
    queue.push(job(loop, 1, level=1))  # level 1 holds 2
    with pytest.raises(errors.UnavailableError):
        queue.push(job(loop, 1, level=1))
    assert len(queue) == 3
    assert queue.take(1) == [high]


def test_priority_order(loop: asyncio.AbstractEventLoop) -> None:
    queue = JobQueue(policy("dynamic_batching { priority_levels: 2 default_priority_level: 2 }"))
    low, high, lower = job(loop, level=2), job(loop, level=1), job(loop, level=2)
    for one in (low, high, lower):
        queue.push(one)
    assert queue.take(3) == [high, low, lower]
    assert len(queue) == 0


def test_timeouts_reject_or_delay(loop: asyncio.AbstractEventLoop) -> None:
    queue = JobQueue(policy(
        "dynamic_batching { priority_levels: 2 default_priority_level: 1 "
        "priority_queue_policy { key: 2 value { timeout_action: DELAY } } }"
    ))  # fmt: skip
    rejected, delayed = job(loop, level=1, deadline=5), job(loop, level=2, deadline=5)
    kept, behind = job(loop, level=1, deadline=50), job(loop, level=2)
    for one in (rejected, delayed, kept, behind):
        queue.push(one)
    assert queue.next_deadline() == 5
    assert queue.expire(10) == [rejected]
    assert queue.take(3) == [kept, behind, delayed]  # the delayed one after its level's others


def test_a_request_may_only_shorten_the_timeout() -> None:
    override = QueuePolicy(default_timeout_ns=10 * MS, allow_override=True)
    assert override.deadline(0, 5_000) == 5 * MS
    assert override.deadline(0, 50_000) == 10 * MS
    assert override.deadline(0, 0) == 10 * MS
    assert QueuePolicy(allow_override=True).deadline(0, 5_000) == 5 * MS  # no default: any
    assert QueuePolicy(default_timeout_ns=10 * MS).deadline(0, 5_000) == 10 * MS
    assert QueuePolicy().deadline(0, 5_000) == 0


def test_a_cancelled_job_leaves_the_queue(loop: asyncio.AbstractEventLoop) -> None:
    queue = JobQueue(policy("dynamic_batching { }"))
    first, second = job(loop), job(loop)
    queue.push(first)
    queue.push(second)
    assert queue.remove(first)
    assert not queue.remove(first)
    assert queue.take(2) == [second]


def test_timed_jobs_are_tracked_through_every_exit(loop: asyncio.AbstractEventLoop) -> None:
    queue = JobQueue(policy("dynamic_batching { default_queue_policy { timeout_action: DELAY } }"))
    removed, delayed, taken = job(loop, deadline=5), job(loop, deadline=5), job(loop, deadline=50)
    for one in (removed, delayed, taken):
        queue.push(one)
    queue.remove(removed)
    assert queue.expire(10) == [] and delayed.delayed
    assert queue.next_deadline() == 50
    assert queue.take(2) == [taken, delayed]
    assert queue.next_deadline() == 0 and queue.expire(100) == []
