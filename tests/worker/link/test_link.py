"""The worker's link over a real socketpair: whoever waits reads for everyone.

Several threads wait for answers to their own calls while the serve loop waits for work;
the server answers in any order; each frame reaches the one it is for. Cancels and
Releases are handled at once, by whichever thread reads them.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.ipc.channel import BlockingChannel, ChannelClosed
from dlserve.worker.link import link

DEADLINE_S = 30.0


@pytest.fixture
def pair() -> Iterator[tuple[link.WorkerLink, BlockingChannel[m.WorkerToServer]]]:
    ours, theirs = socket.socketpair()
    worker = link.WorkerLink(BlockingChannel(ours, codec.to_worker))
    server = BlockingChannel(theirs, codec.to_server)
    try:
        yield worker, server
    finally:
        ours.close()
        theirs.close()


def test_answers_reach_their_callers_in_any_order(
    pair: tuple[link.WorkerLink, BlockingChannel[m.WorkerToServer]],
) -> None:
    worker, server = pair
    calls = [worker.next_call_id() for _ in range(3)]
    for call in calls:
        worker.open_call(call)
    got: dict[int, int] = {}

    def wait(call: int) -> None:
        answer = worker.wait_answer(call, time.monotonic() + DEADLINE_S)
        assert answer is not None and isinstance(answer[0], m.BlsReply)
        got[call] = answer[0].outputs[0].offset

    threads = [threading.Thread(target=wait, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    work: list[m.ServerToWorker] = []
    serve = threading.Thread(target=lambda: work.append(worker.recv()[0]))
    serve.start()
    for call in reversed(calls):  # answers in reverse order, work in the middle
        ref = m.TensorRef("x", "FP32", [1], m.Where.PAYLOAD, call * 10, 0)
        server.send(m.BlsReply(call, [ref]))
        if call == calls[1]:
            server.send(m.Release([64]))
    for thread in [*threads, serve]:
        thread.join(DEADLINE_S)
    assert got == {call: call * 10 for call in calls}
    assert work == [m.Release([64])]  # no on_release yet: the serve loop gets it


def test_cancel_and_release_are_handled_by_whoever_reads(
    pair: tuple[link.WorkerLink, BlockingChannel[m.WorkerToServer]],
) -> None:
    worker, server = pair
    cancelled: list[int] = []
    released: list[tuple[list[int], list[int]]] = []
    worker.on_cancel = cancelled.append
    worker.on_release = lambda offsets, gpu: released.append((offsets, gpu))
    call = worker.next_call_id()
    worker.open_call(call)
    server.send(m.Cancel(7))
    server.send(m.Release([128], gpu=[3]))
    server.send(m.BlsReply(call))
    answer = worker.wait_answer(call, time.monotonic() + DEADLINE_S)
    assert answer is not None and answer[0] == m.BlsReply(call)
    assert cancelled == [7] and released == [([128], [3])]


def test_an_answer_nobody_waits_for_gives_its_lent_outputs_back(
    pair: tuple[link.WorkerLink, BlockingChannel[m.WorkerToServer]],
) -> None:
    worker, server = pair
    ref = m.TensorRef("x", "FP32", [4], m.Where.PEER_ARENA, 256, 16, 5, "/proc/x")
    server.send(m.BlsReply(99, [ref]))  # call 99 was closed (timed out, say)
    server.send(m.Shutdown())
    assert isinstance(worker.recv()[0], m.Shutdown)
    worker.send(m.Closed())
    msg, _ = server.recv()
    assert msg == m.Closed()
    msg, _ = server.recv()
    assert msg == m.PeerRelease([5], [256])


def test_a_wait_ends_at_its_deadline_or_when_the_server_goes(
    pair: tuple[link.WorkerLink, BlockingChannel[m.WorkerToServer]],
) -> None:
    worker, server = pair
    call = worker.next_call_id()
    worker.open_call(call)
    assert worker.wait_answer(call, time.monotonic() + 0.05) is None
    server.close()
    with pytest.raises(ChannelClosed):
        worker.wait_answer(call, time.monotonic() + DEADLINE_S)
