"""The worker's link to the server, shared by the serve loop and the model code it runs.

A worker serves one blocking channel. The serve loop reads a frame, runs the model,
writes the reply; model code may meanwhile need answers from the server (a BLS call's
responses, ``Metric.value()``, ``is_model_ready``), from the thread that runs
``execute`` or from threads the model started. Whichever thread needs a frame takes
the *reader* role (one at a time), reads one frame and routes it by its type (one
table): an answer goes to the call that waits for it (by call id), a Cancel marks its
request and a Release frees output-arena space at once, a Credit goes to the flow
control of decoupled responses (``flow.py``), and any other frame (Infer, Shutdown ...)
to the serve loop. So an answer is read whether ``execute`` blocks in ``exec()``, awaits
``async_exec()``, or has returned while a thread of the model waits.

Other workers may call this instance directly (BLS without the server:
``worker/bls/direct_callee.py``): the serve loop then waits on their connections too, and
runs their requests in turn with the server's. Calls this worker makes directly keep
their connections in ``worker/bls/direct_caller.py``.

Links are per thread (the server can run several in-process workers as threads of
one process, each with its own channel). A worker process also makes its link the
process-wide default, so that threads the model starts find it.
"""

from __future__ import annotations

import contextvars
import itertools
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.ipc.channel import BlockingChannel, ChannelClosed
from dlserve.pb_utils.exceptions import TritonModelException
from dlserve.worker.bls import cuda_peers
from dlserve.worker.bls.direct_callee import Served, ServedCalls, receive_fds
from dlserve.worker.bls.direct_caller import DirectCalls
from dlserve.worker.link import bad_frames as frames
from dlserve.worker.link.flow import FlowControl

if TYPE_CHECKING:
    from dlserve.worker.bls.tensors import BlsMemory

Frame = tuple[m.ServerToWorker, memoryview]
Answer = m.MetricValueReply | m.BlsReply | m.ControlReply | m.DirectTargets
CALL_TIMEOUT_S: Final = 30.0


class WorkerLink:
    """One worker's channel: sends from any thread, reads by whoever holds the reader role."""

    def __init__(
        self, channel: BlockingChannel[m.ServerToWorker], fd_socket: socket.socket | None = None
    ) -> None:
        self._channel = channel
        self._fd_socket = fd_socket  # descriptors from the server (direct BLS sockets)
        self.spin_ns = channel.spin_ns
        self.direct = DirectCalls(self)  # models this one calls directly
        self.served = ServedCalls(channel.spin_ns)  # workers that call this one directly
        self._queued: deque[Frame] = deque()  # frames for the serve loop
        self._answers: dict[int, deque[tuple[Answer, memoryview]]] = {}  # by call id
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # taken directly: cheaper than the Condition's methods
        self._cond = threading.Condition(self._lock)
        self._reading = False  # a thread holds the reader role
        self._waiters = 0  # threads waiting on the condition (none: no notify needed)
        self._call_ids = itertools.count(1)
        self.closed = False  # the server has gone away
        self.on_cancel: Callable[[int], None] | None = None  # the runner marks the request
        # output-arena space (and lent GPU outputs) back
        self.on_release: Callable[[list[int], list[int]], None] | None = None
        self._peer_releases: deque[tuple[int, int]] = deque()  # (arena, offset) mapped by BLS
        self._call_stops: deque[int] = deque()  # decoupled BLS calls nobody listens to now
        self.model_name = ""  # set when a Load arrives; Logger lines carry it
        self._upstream: list[str] = []  # BLS: the instances upstream of the request executing
        self.instance = ""  # this instance in a BLS call chain (``m.chain_entry``)
        # between the end of initialize and the start of finalize: BLS calls may be made
        self.serving = False
        self.memory: BlsMemory | None = None  # BLS: tensors that travel by reference
        self.flow = FlowControl(self, self._lock)  # decoupled requests' responses
        self._routes = self._route_table()

    @property
    def upstream(self) -> list[str]:
        """BLS: the instances upstream of the request executing (a call into one of them is
        circular); that of the coroutine asking, where ``execute`` coroutines run side by
        side (:func:`upstream_context`)."""
        chain = _UPSTREAM.get()
        return self._upstream if chain is None else chain

    @upstream.setter
    def upstream(self, chain: list[str]) -> None:
        self._upstream = chain

    def send(self, message: m._Msg, payload: Sequence[bytes | memoryview] = ()) -> None:
        """Send one frame; raises ChannelClosed when the server has gone away. A reply that
        cannot be encoded goes as its request's error; another frame that cannot be, as
        TritonModelException (``frames.sendable``)."""
        with self._send_lock:
            try:
                records = self.direct.take_records()
                if not records:  # the usual: one frame as it is
                    self._send_one(message, payload)
                else:
                    self._send_frames(_with_records([(message, payload)], records))
                self._send_pending()
            except (BrokenPipeError, ConnectionResetError) as exc:
                self.closed = True
                raise ChannelClosed(f"connection closed: {exc}") from None
        self.direct.flush()

    def send_many(self, frames: Sequence[tuple[m._Msg, Sequence[bytes | memoryview]]]) -> None:
        """Send frames in one system call (the replies of one execute: the server wakes
        once for them); raises ChannelClosed when the server has gone away."""
        with self._send_lock:
            try:
                records = self.direct.take_records()
                self._send_frames(_with_records(frames, records) if records else frames)
                self._send_pending()
            except (BrokenPipeError, ConnectionResetError) as exc:
                self.closed = True
                raise ChannelClosed(f"connection closed: {exc}") from None
        self.direct.flush()

    def _send_one(self, message: m._Msg, payload: Sequence[bytes | memoryview]) -> None:
        try:
            self._channel.send(message, payload)
        except codec.UnencodableFrame as failed:  # what stands in for it (frames.sendable)
            substitute = frames.sendable(failed, self.model_name, self.on_release)
            self._send_frames([(substitute, payload)])

    def _send_frames(self, batch: Sequence[tuple[m._Msg, Sequence[bytes | memoryview]]]) -> None:
        """``batch`` in one system call; those that cannot be encoded replaced first (a
        reply may be replaced twice: its text made UTF-8, then by its request's error)."""
        for _ in range(2 * len(batch)):
            try:
                self._channel.send_many(batch)
                return
            except codec.UnencodableFrame as failed:
                substitute = frames.sendable(failed, self.model_name, self.on_release)
                batch = frames.replace(batch, failed, substitute)
        self._channel.send_many(batch)

    def _send_pending(self) -> None:
        """What waits to ride along with a frame: peer releases, BLS call stops."""
        if self._peer_releases:
            self._channel.send(self._take_peer_releases())
        while self._call_stops:
            self._channel.send(m.BlsCredit(self._call_stops.popleft(), stop=True))

    def release_peer(self, arena: int, offset: int) -> None:
        """A BLS output mapped from another worker's arena is gone: its space goes back
        with the next frame sent. Safe from a finalizer (no lock, no send here)."""
        self._peer_releases.append((arena, offset))

    def stop_call_later(self, call: int) -> None:
        """Nobody listens to decoupled BLS call ``call`` any more: the server hears it with
        the next frame sent. Safe from a finalizer (no lock, no send here)."""
        self._call_stops.append(call)

    def flush_peer_releases(self) -> None:
        if self._peer_releases:
            with self._send_lock:
                if self._peer_releases:
                    self._channel.send(self._take_peer_releases())

    def _take_peer_releases(self) -> m.PeerRelease:
        arenas: list[int] = []
        offsets: list[int] = []
        while self._peer_releases:
            arena, offset = self._peer_releases.popleft()
            arenas.append(arena)
            offsets.append(offset)
        cuda_peers.settle()  # lent GPU outputs among them: nothing to wait for otherwise
        return m.PeerRelease(arenas, offsets)

    def close_direct(self) -> None:
        """The serve loop ends: every direct connection, both ways, is closed."""
        self.served.close_all()
        self.direct.close_all()

    # -- the serve loop -----------------------------------------------------------------
    def recv(self) -> Frame:
        """The next frame from the server (for a serve loop that serves no direct callers)."""
        frame, direct = self.next_work()
        assert direct is None, "a direct caller's frame: the serve loop uses next_work"
        return frame

    def next_work(self) -> tuple[Frame, Served | None]:
        """The next frame for the serve loop, and the connection of the worker that sent it
        when it came from a direct caller (None: from the server). Queued ones first.
        Raises ChannelClosed when the server has gone away."""
        while True:
            with self._lock:
                while True:
                    if self._queued:
                        return self._queued.popleft(), None
                    if self.closed:
                        raise ChannelClosed("connection closed")
                    if not self._reading:
                        self._reading = True
                        break
                    self._wait(None)
            if self.served.connections:
                direct = self._read_direct()
                if direct is not None:
                    return direct
                continue
            frame = self._read(None)
            if self._served_frame(frame):
                return frame, None  # type: ignore[return-value]

    def _read_direct(self) -> tuple[Frame, Served] | None:
        """A frame from a direct caller, or None after handling one from the server (or a
        connection that closed); the caller holds the reader role, given up here."""
        try:
            source = self.served.ready(self._channel)
        except BaseException:
            with self._lock:
                self._stop_reading()
            raise
        if source is None:
            frame = self._read(None)
            if self._served_frame(frame):
                self._queued.append(frame)  # type: ignore[arg-type]
            return None
        with self._lock:
            self._stop_reading()
        try:
            return source.channel.recv(), source
        except codec.UnreadableFrame as bad:  # that call fails; the connection goes on
            self._answer_unreadable(source, bad)
            return None
        except (ChannelClosed, OSError):
            self.served.lost(source, self.on_release)
            return None

    def _answer_unreadable(self, source: Served, bad: codec.UnreadableFrame) -> None:
        reply = frames.error_reply(bad, "a direct caller")
        if reply is None:
            frames.report(bad, "a direct caller")
            return
        try:
            source.channel.send(reply)
        except OSError:
            self.served.lost(source, self.on_release)

    def _served_frame(self, frame: Frame | None) -> bool:
        """Give up the reader role and route ``frame``; True: it is the serve loop's."""
        with self._lock:  # one locked section: give up the role, hand over or route
            self._stop_reading()
            if frame is None:
                return False
            route = self._routes.get(type(frame[0]))
            if route is not None:  # answers, Cancel, Release, Shutdown ...: routed here
                route(frame)
                self.notify()
                return False
            if not self._queued:  # the usual case: hand it over directly
                return True
            self._queued.append(frame)
            return False

    # -- calls: a question sent, answers awaited ------------------------------------------
    def next_call_id(self) -> int:
        return next(self._call_ids)

    def open_call(self, call: int) -> None:
        """Make room for the answers of ``call`` before the question is sent."""
        with self._lock:
            self._answers[call] = deque()

    def close_call(self, call: int) -> None:
        """Answers of ``call`` that arrive from now on are dropped."""
        with self._lock:
            self._answers.pop(call, None)

    def wait_answer(self, call: int, deadline: float | None) -> tuple[Answer, memoryview] | None:
        """The next answer to ``call``; None past ``deadline`` (monotonic seconds).

        Raises ChannelClosed when the server has gone away.
        """
        while True:
            with self._lock:
                while True:
                    answers = self._answers.get(call)
                    if answers:
                        return answers.popleft()
                    if self.closed:
                        raise ChannelClosed("connection closed")
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return None
                    if not self._reading:
                        self._reading = True
                        break
                    self._wait(remaining)
            frame = self._read(remaining)
            with self._lock:
                self._stop_reading()
                if frame is not None:
                    self._dispatch(frame)

    def poll(self, *, buffered_only: bool = False) -> None:
        """Dispatch the frames already arrived, without waiting (``is_cancelled()``).
        ``buffered_only``: only those already read ahead (no system call)."""
        while True:
            if buffered_only and not self._channel.buffered():
                return  # the usual case, told without the lock (a reader may be at work)
            with self._lock:
                if self._reading or self.closed:
                    return
                if buffered_only and not self._channel.buffered():
                    return
                self._reading = True
            frame = self._read(0.0)
            with self._lock:
                self._stop_reading()
                if frame is None:
                    return
                self._dispatch(frame)

    def call(
        self, request: m.MetricValueCall, timeout: float = CALL_TIMEOUT_S
    ) -> m.MetricValueReply:
        """Send ``request`` and return the server's reply to it."""
        self.open_call(request.call)
        try:
            self.send(request)
            answer = self.wait_answer(request.call, time.monotonic() + timeout)
        except ChannelClosed:
            raise TritonModelException("the connection to the server is closed") from None
        finally:
            self.close_call(request.call)
        if answer is None:
            raise TritonModelException(f"the server did not answer within {timeout:g} s")
        reply = answer[0]
        assert isinstance(reply, m.MetricValueReply)
        if reply.error:
            raise TritonModelException(reply.error)
        return reply

    # -- reading ------------------------------------------------------------------------
    def _read(self, timeout: float | None) -> Frame | None:
        """One frame, or None when none came within ``timeout`` or the connection is gone
        (``closed`` says which). The caller holds the reader role and gives it up after
        (:meth:`_stop_reading`, with the lock held)."""
        try:
            if timeout is not None and not self._channel.buffered():
                readable, _, _ = select.select([self._channel.fileno()], [], [], timeout)
                if not readable:
                    return None
            return self._channel.recv()
        except codec.UnreadableFrame as bad:
            return self._unreadable(bad)
        except (ChannelClosed, OSError, ValueError):
            self.closed = True  # seen by the others once the role is given up
            return None
        except BaseException:  # the caller will not get to give the role up
            with self._lock:
                self._stop_reading()
            raise

    def _unreadable(self, bad: codec.UnreadableFrame) -> Frame | None:
        """A frame from the server that cannot be read: the error answer it stands for (the
        call that waits for it fails), a request's error reply sent back, or nothing."""
        for fd in receive_fds(self._fd_socket, frames.descriptors(bad)):  # came beside it
            os.close(fd)
        answer = frames.error_answer(bad, "the server")
        if answer is not None:
            return answer, bad.payload
        reply = frames.error_reply(bad, "the server")
        if reply is None:
            frames.report(bad, "the server")
            return None
        try:
            self.send(reply)
        except ChannelClosed:
            self.closed = True
        return None

    def _stop_reading(self) -> None:
        """Give up the reader role (the condition's lock is held)."""
        self._reading = False
        self.notify()

    def _wait(self, timeout: float | None) -> None:
        """Wait for a notification (the condition's lock is held)."""
        self._waiters += 1
        try:
            self._cond.wait(timeout)
        finally:
            self._waiters -= 1

    def notify(self) -> None:
        """Wake the threads waiting on the condition, if any (the lock is held)."""
        if self._waiters:
            self._cond.notify_all()

    # -- the reader role, for flow control (FlowControl.hold_send) ------------------------
    def claim_reader(self, timeout: float | None) -> bool:
        """Take the reader role if no thread holds it (True), else wait for a notification
        (the condition's lock is held)."""
        if not self._reading:
            self._reading = True
            return True
        self._wait(timeout)
        return False

    def read_and_route(self, timeout: float | None) -> None:
        """Read one frame within ``timeout``, give the reader role up and route the frame
        (the role is held, the lock is not)."""
        frame = self._read(timeout)
        with self._lock:
            self._stop_reading()
            if frame is not None:
                self._dispatch(frame)

    # -- routing ------------------------------------------------------------------------
    def _dispatch(self, frame: Frame) -> None:
        """Route one frame (the condition's lock is held): by its type, else to the serve
        loop."""
        route = self._routes.get(type(frame[0]))
        if route is None:
            self._queued.append(frame)
        else:
            route(frame)
        self.notify()

    def _route_table(self) -> dict[type, Callable[[Any], None]]:
        """The frames whoever reads handles at once (the condition's lock is held), by
        type; each handler takes the frame of its type. Any other is the serve loop's."""
        answer = self._answer
        return {
            m.BlsReply: self._bls_reply,
            m.MetricValueReply: answer,
            m.ControlReply: answer,
            m.Cancel: self._cancel,
            m.Release: self._release,
            m.Credit: self.flow.credit,
            m.Shutdown: self._shutdown,
            m.DirectTargets: self._direct_targets,
            m.DirectAccept: self._direct_accept,
            m.DirectStale: self._direct_stale,
        }

    def _answer(self, frame: tuple[Answer, memoryview]) -> None:
        """To the call that waits for it; dropped when none does any more."""
        answers = self._answers.get(frame[0].call)
        if answers is not None:
            answers.append(frame)

    def _bls_reply(self, frame: tuple[m.BlsReply, memoryview]) -> None:
        answers = self._answers.get(frame[0].call)
        if answers is not None:
            answers.append(frame)
            return
        for ref in frame[0].outputs:  # nobody listens: its outputs go back
            if ref.where == m.Where.PEER_ARENA:
                self.release_peer(ref.region, ref.offset)
            elif ref.where == m.Where.CUDA_IPC and ref.lend:
                self.release_peer(ref.region, -ref.lend)

    def _cancel(self, frame: tuple[m.Cancel, memoryview]) -> None:
        if self.on_cancel is not None:  # before Load there is nothing to cancel
            self.on_cancel(frame[0].rid)

    def _release(self, frame: tuple[m.Release, memoryview]) -> None:
        if self.on_release is not None:  # thread-safe: the serve loop may be busy
            self.on_release(frame[0].offsets, frame[0].gpu)
        else:
            self._queued.append(frame)

    def _shutdown(self, frame: tuple[m.Shutdown, memoryview]) -> None:
        self.flow.stop()  # a send held back gives up
        self._queued.append(frame)

    # direct BLS bookkeeping: descriptors that came beside a frame are picked up as it is
    # routed, so in the order the frames came
    def _direct_targets(self, frame: tuple[m.DirectTargets, memoryview]) -> None:
        msg = frame[0]
        if msg.target:
            self.direct.took_fds(msg, receive_fds(self._fd_socket, len(msg.instances)))
        answers = self._answers.get(msg.call)
        if answers is not None:
            answers.append(frame)
        else:  # nobody waits: its sockets are closed
            self.direct.drop_fds(msg.call)

    def _direct_accept(self, frame: tuple[m.DirectAccept, memoryview]) -> None:
        self.served.accept(frame[0], receive_fds(self._fd_socket, 1))

    def _direct_stale(self, frame: tuple[m.DirectStale, memoryview]) -> None:
        self.direct.stale(frame[0].model_name)


def _with_records(
    frames: Sequence[tuple[m._Msg, Sequence[bytes | memoryview]]], records: list[m.DirectRecord]
) -> Sequence[tuple[m._Msg, Sequence[bytes | memoryview]]]:
    """``frames`` carrying direct calls' records: in the first reply (counted as it is
    handled), else in a DirectStats frame ahead of them (counted before they are)."""
    for message, _ in frames:
        if isinstance(message, m.InferDone):
            message.direct = records
            return frames
    return [(m.DirectStats(records), ()), *frames]


_local = threading.local()
_process_link: WorkerLink | None = None
_UPSTREAM: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "dlserve_upstream", default=None
)


def upstream_context(chain: list[str]) -> contextvars.Context:
    """A context in which ``WorkerLink.upstream`` is ``chain``: an ``execute`` coroutine
    that runs beside others of the same instance keeps its own requests' chain."""
    context = contextvars.copy_context()
    context.run(_UPSTREAM.set, chain)
    return context


def install(link: WorkerLink, *, process_wide: bool = False) -> None:
    """Make ``link`` this thread's link (and the process default when asked)."""
    global _process_link
    _local.link = link
    if process_wide:
        _process_link = link


def uninstall(link: WorkerLink) -> None:
    global _process_link
    if getattr(_local, "link", None) is link:
        _local.link = None
    if _process_link is link:
        _process_link = None


def current() -> WorkerLink | None:
    """This thread's link, else the process default; None outside a worker."""
    link: WorkerLink | None = getattr(_local, "link", None)
    return link if link is not None else _process_link


_forked = False  # this process is a copy of a worker, forked by the model's code


def forked() -> bool:
    """Whether this process was forked from a worker (``multiprocessing`` with its default
    'fork' start method, inside ``execute``): it has no link of its own."""
    return _forked


def _drop_links_in_child() -> None:
    """A forked copy of a worker shares the worker's sockets: a frame it sent would mix
    with the worker's, and an answer it read would be lost to the worker. So it has no
    link at all, and what needs the server fails at once in it (``forked()`` says why)."""
    global _forked, _process_link, _local
    _forked = True
    _process_link = None
    _local = threading.local()


os.register_at_fork(after_in_child=_drop_links_in_child)
