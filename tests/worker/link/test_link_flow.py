"""Flow control in the worker's link, over a real socketpair: a decoupled request's send
waits while its window is full, and whoever reads the server's Credit lets it go; a
Cancel, a Shutdown or the server's going away release it too."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.ipc.channel import BlockingChannel
from dlserve.worker.link import link

DEADLINE_S = 30.0
Pair = tuple[link.WorkerLink, BlockingChannel[m.WorkerToServer], socket.socket]


@pytest.fixture
def pair() -> Iterator[Pair]:
    ours, theirs = socket.socketpair()
    worker = link.WorkerLink(BlockingChannel(ours, codec.to_worker))
    server = BlockingChannel(theirs, codec.to_server)
    try:
        yield worker, server, theirs
    finally:
        ours.close()
        theirs.close()


def never() -> bool:
    return False


def fill(worker: link.WorkerLink, rid: int) -> None:
    worker.flow.open_window(rid)
    for _ in range(m.WINDOW_RESPONSES):
        assert worker.flow.hold_send(rid, never)  # room: no wait


def held(
    worker: link.WorkerLink, rid: int, cancelled: Callable[[], bool] = never
) -> tuple[threading.Thread, list[bool]]:
    """A thread that sends one more response of ``rid``; its outcome lands in the list."""
    outcome: list[bool] = []
    thread = threading.Thread(target=lambda: outcome.append(worker.flow.hold_send(rid, cancelled)))
    thread.start()
    return thread, outcome


def test_a_full_window_holds_the_send_until_credit_comes(pair: Pair) -> None:
    worker, server, _ = pair
    fill(worker, 1)
    thread, outcome = held(worker, 1)
    assert not outcome  # it waits (reading for everyone meanwhile)
    server.send(m.Credit(1, m.WINDOW_RESPONSES // 2))
    thread.join(DEADLINE_S)
    assert outcome == [True]
    for _ in range(m.WINDOW_RESPONSES // 2 - 1):  # the rest of the credit: no wait
        assert worker.flow.hold_send(1, never)


def test_credit_read_by_the_serve_loop_wakes_the_sender(pair: Pair) -> None:
    worker, server, _ = pair
    fill(worker, 1)
    frames: list[m.ServerToWorker] = []
    serve = threading.Thread(target=lambda: frames.append(worker.recv()[0]))
    serve.start()  # the serve loop holds the reader role first, or the sender does
    thread, outcome = held(worker, 1)
    server.send(m.Credit(1, 1))
    thread.join(DEADLINE_S)
    server.send(m.Release([0]))  # work for the serve loop
    serve.join(DEADLINE_S)
    assert outcome == [True] and frames == [m.Release([0])]


def test_bytes_fill_the_window_too(pair: Pair) -> None:
    worker, server, _ = pair
    worker.flow.open_window(2)
    assert worker.flow.hold_send(2, never)
    worker.flow.sent_bytes(2, m.WINDOW_BYTES)  # one response of the whole byte budget
    thread, outcome = held(worker, 2)
    assert not outcome
    server.send(m.Credit(2, 1, m.WINDOW_BYTES))
    thread.join(DEADLINE_S)
    assert outcome == [True]


def test_cancel_releases_a_held_send_and_it_is_given_up(pair: Pair) -> None:
    worker, server, _ = pair
    cancelled: set[int] = set()
    worker.on_cancel = cancelled.add
    fill(worker, 3)
    thread, outcome = held(worker, 3, lambda: 3 in cancelled)
    server.send(m.Cancel(3))
    thread.join(DEADLINE_S)
    assert outcome == [False]
    assert not worker.flow.hold_send(3, lambda: 3 in cancelled)  # later sends: given up at once


def test_shutdown_releases_a_held_send(pair: Pair) -> None:
    worker, server, _ = pair
    fill(worker, 4)
    thread, outcome = held(worker, 4)
    server.send(m.Shutdown())
    thread.join(DEADLINE_S)
    assert outcome == [False]
    assert worker.recv()[0] == m.Shutdown()  # the serve loop still gets it


def test_the_server_going_away_releases_a_held_send(pair: Pair) -> None:
    worker, _, theirs = pair
    fill(worker, 5)
    thread, outcome = held(worker, 5)
    theirs.close()
    thread.join(DEADLINE_S)
    assert outcome == [False]


def test_a_send_held_when_the_final_flag_goes_is_given_up(pair: Pair) -> None:
    """Two threads of the model: one waits for room, the other sends the final flag."""
    worker, _, _ = pair
    fill(worker, 6)
    thread, outcome = held(worker, 6)
    worker.flow.close_window(6)
    thread.join(DEADLINE_S)
    assert outcome == [False]
    assert not worker.flow.hold_send(6, never)  # nothing follows the final flag


def test_several_threads_share_one_window(pair: Pair) -> None:
    """Four threads send 4 windows' worth of one request's responses: never more than the
    window ahead of the credit given, and all of them go once the credit comes."""
    worker, server, _ = pair
    worker.flow.open_window(7)
    done: list[int] = []
    lock = threading.Condition()

    per_thread = m.WINDOW_RESPONSES
    total = 4 * per_thread

    def send_some() -> None:
        for _ in range(per_thread):
            assert worker.flow.hold_send(7, never)
            with lock:
                done.append(1)
                lock.notify_all()

    threads = [threading.Thread(target=send_some) for _ in range(4)]
    for thread in threads:
        thread.start()
    granted = m.WINDOW_RESPONSES
    deadline = time.monotonic() + DEADLINE_S
    while granted < total + m.WINDOW_RESPONSES:
        expected = min(granted, total)
        with lock:
            assert lock.wait_for(lambda n=expected: len(done) >= n, deadline - time.monotonic())
            assert len(done) <= granted
        server.send(m.Credit(7, 8))
        granted += 8
    for thread in threads:
        thread.join(DEADLINE_S)
    assert len(done) == total
