"""BLS calls sent straight to the callee's instance, not through the server: the caller's
side (the server's is ``server/core/calls/direct_broker.py``, the callee's
``worker/bls/direct_callee.py``).

A call goes direct when it has no timeout, no trace, no sequence id or flags, is not
decoupled, and the server says the callee may be called so; and when one of the
callee's instances that is not upstream of this call (in its call chain: it waits for
this call) is free on this worker's connections. Everything else, and a call the callee
did not run because it was stopping, goes through the server as before (which refuses
a call whose chain holds every instance of the callee, with its message).

The first call to a model asks the server (``DirectOpen``); its answer says whether the
model may be called directly and, if so, gives the callee's tensors (to check a call as
the server would) and one connected socket per instance. A call then takes a free
connection (one call at a time on each; none free: the call goes through the server),
sends an ``Infer`` frame and reads the ``InferDone``. Lent outputs (the callee's output
arena, its GPU memory) are given back over the same connection, riding on the next frame
to it or sent when this worker next writes to the server; a connection is closed only
once nothing lent over it is still held here.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import msgspec

from dlserve import errors
from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.ipc.channel import BlockingChannel, ChannelClosed
from dlserve.pb_utils.exceptions import TritonError, TritonModelException
from dlserve.pb_utils.request import InferenceRequest, InferenceResponse, InferenceTrace
from dlserve.pb_utils.tensor import Tensor
from dlserve.tensors import dtypes
from dlserve.tensors.validation import SpecValidator, TensorSpec, tensor_spec
from dlserve.types import InferRequest, InputTensor, RegionRef, RequestedOutput
from dlserve.worker.bls import cuda_peers
from dlserve.worker.bls.tensors import encode_inputs, lent_count, response, triton_code

if TYPE_CHECKING:
    from dlserve.worker.link.link import WorkerLink

OPEN_TIMEOUT_S: Final = 30.0  # the server answers a DirectOpen at once, refusal or not
_BY_REFERENCE: Final = (m.Where.INPUT_ARENA, m.Where.OUTPUT_ARENA)


class CallSpec(msgspec.Struct, gc=False):
    """What a BLS request asks of the callee, besides its inputs."""

    request_id: str
    outputs: list[str]
    parameters: dict[str, m.ParamValue]
    chain: list[str]  # the instances upstream of the callee (m.chain_entry), this one last


class Connection:
    """The caller's end of a socket to one callee instance."""

    def __init__(self, fd: int, instance: m.DirectInstance, spin_ns: int, entry: str) -> None:
        self.channel: BlockingChannel[m.WorkerToServer] = BlockingChannel(
            socket.socket(fileno=fd), codec.to_server, spin_ns
        )
        self.instance = instance
        self.entry = entry  # the instance as a call chain names it
        self.busy = threading.Lock()  # held by the call using it
        self.returns: deque[int] = deque()  # lent outputs given back: offset, or -lend id
        self.lent = 0  # outputs lent over it not given back yet (changed while ``busy``)
        self.closed = False

    def give_back(self, arena: int, offset: int) -> None:
        """A lent output is no longer held here (a finalizer: no lock, no send)."""
        self.returns.append(offset)

    def release_frame(self) -> m.Release | None:
        """The outputs given back since the last frame (``busy`` is held)."""
        if not self.returns:
            return None
        offsets: list[int] = []
        gpu: list[int] = []
        while self.returns:
            offset = self.returns.popleft()
            if offset < 0:
                gpu.append(-offset)
            else:
                offsets.append(offset)
            self.lent -= 1
        if gpu:
            cuda_peers.settle()
        return m.Release(offsets, gpu)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.channel.close()


class Target:
    """One callee version this worker calls directly, and its instances."""

    def __init__(self, model: str, msg: m.DirectTargets, connections: list[Connection]) -> None:
        self.model = model
        self.id = msg.target
        self.connections = connections
        inputs = [_spec(s) for s in msg.inputs]
        self.validator = SpecValidator(model, msg.max_batch_size, inputs,
                                       [_spec(s) for s in msg.outputs])  # fmt: skip
        self._passed: dict[_Form, int] = {}  # forms of calls that passed: their batch size

    def check(self, call: CallSpec, refs: list[m.TensorRef], payload: list[memoryview]) -> int:
        """The call's batch size, checked as the server would check it (raises DlserveError).
        The checks read only the inputs' names, types, shapes and sizes and the outputs'
        names, so a call of the same form as one that passed passes again unchecked. BYTES
        inputs are always checked: their element count is in their bytes."""
        form = _form(refs, call.outputs)
        if form is not None:
            batch = self._passed.get(form)
            if batch is not None:
                return batch
        _, batch = self.validator.check(_checked_form(self.model, call, refs, payload))
        if form is not None:
            if len(self._passed) >= _FORMS_KEPT:
                self._passed.clear()
            self._passed[form] = batch
        return batch

    def take(self, device: int | None, chain: list[str]) -> Connection | None:
        """A free connection, on ``device`` where one is, to an instance not in the call's
        ``chain`` (each there waits for this call); None when all such are busy."""
        ordered = self.connections
        if device is not None and len(ordered) > 1:
            ordered = sorted(ordered, key=lambda c: c.instance.device != device)
        for conn in ordered:
            if conn.entry in chain:
                continue
            if not conn.closed and conn.busy.acquire(blocking=False):
                return conn
        return None


_Form = tuple[tuple[tuple[str, str, tuple[int, ...], int], ...], tuple[str, ...]]
_FORMS_KEPT: Final = 64  # forms of calls that passed, per callee


def _form(refs: list[m.TensorRef], outputs: list[str]) -> _Form | None:
    """What the checks of a call read: each input's name, type, shape and size, and the
    outputs asked for; None when an input is BYTES."""
    inputs = []
    for ref in refs:
        if ref.datatype == "BYTES":
            return None
        inputs.append((ref.name, ref.datatype, tuple(ref.shape), ref.nbytes))
    return tuple(inputs), tuple(outputs)


def _spec(spec: m.DirectSpec) -> TensorSpec:
    return tensor_spec(spec.name, dtypes.BY_WIRE[spec.datatype], tuple(spec.dims),
                       optional=spec.optional)  # fmt: skip


class DirectCalls:
    """This worker's direct callees (by model name and version), the records of its calls
    for the server, and the descriptors that came with answers not yet read."""

    def __init__(self, link: WorkerLink) -> None:
        self._link = link
        self._lock = threading.Lock()  # never held while the link's lock is taken
        self._targets: dict[tuple[str, int], Target | str] = {}  # str: why not directly
        self._live: list[Connection] = []  # the targets' connections
        self._retired: list[Connection] = []  # closed once nothing lent over them is held
        self._fds: dict[int, list[int]] = {}  # DirectTargets' descriptors, by call
        self._records: list[m.DirectRecord] = []
        self.arenas: tuple[list[int], list[str]] = ([], [])  # this worker's own
        self.active = False  # any connection at all (flush has work to look at)

    # -- targets --------------------------------------------------------------------------
    def target(self, model: str, version: int) -> Target | None:
        """The model's direct target; asks the server the first time. None: not directly."""
        with self._lock:
            found = self._targets.get((model, version))
        if found is None:
            opened = self._open(model, version)
            if opened is None:
                return None  # not now (the model is not ready ...): asked again next time
            with self._lock:
                found = self._targets.setdefault((model, version), opened)
                if isinstance(opened, Target):  # another thread's came first: ours goes
                    (self._live if found is opened else self._retired).extend(opened.connections)
        return found if isinstance(found, Target) else None

    def _open(self, model: str, version: int) -> Target | str | None:
        """The answer of the server: a target, a lasting refusal (its reason), or None."""
        link = self._link
        call = link.next_call_id()
        link.open_call(call)
        try:
            link.send(m.DirectOpen(call, model, version))
            answer = link.wait_answer(call, time.monotonic() + OPEN_TIMEOUT_S)
        except ChannelClosed:
            return None
        finally:
            link.close_call(call)
        with self._lock:
            fds = self._fds.pop(call, [])
        if answer is None or not isinstance(answer[0], m.DirectTargets):
            _close_fds(fds)
            return None
        msg = answer[0]
        if not msg.target or len(fds) != len(msg.instances):
            _close_fds(fds)
            return msg.error if msg.lasting else None
        self.arenas = (msg.arena_ids, msg.arena_paths)
        spin = link.spin_ns
        connections = [
            Connection(fd, i, spin, m.chain_entry(model, msg.model_version, i.name))
            for fd, i in zip(fds, msg.instances, strict=True)
        ]
        self.active = True
        return Target(model, msg, connections)

    def took_fds(self, msg: m.DirectTargets, fds: list[int]) -> None:
        """The descriptors of an answer, picked up as it was read (the link's lock held)."""
        with self._lock:
            self._fds[msg.call] = fds

    def drop_fds(self, call: int) -> None:
        """An answer nobody waits for any more: its descriptors are closed."""
        with self._lock:
            fds = self._fds.pop(call, [])
        _close_fds(fds)

    def stale(self, model: str) -> None:
        """The server says ``model`` changed: ask again at the next call."""
        with self._lock:
            for key in [k for k in self._targets if k[0] == model]:
                self._retire(self._targets.pop(key))

    def lost(self, target: Target, conn: Connection) -> None:
        """``conn`` broke (the instance stopped or died): the model is asked for again."""
        conn.close()
        with self._lock:
            for key, found in list(self._targets.items()):
                if found is target:
                    del self._targets[key]
                    self._retire(target)

    def _retire(self, target: Target | str) -> None:
        """Its connections close once nothing lent over them is held (lock held)."""
        if isinstance(target, Target):
            self._live = [c for c in self._live if c not in target.connections]
            self._retired += [c for c in target.connections if not c.closed]

    def close_all(self) -> None:
        """This worker stops: its connections go (the callees release what they lent)."""
        with self._lock:
            connections = self._live + self._retired
            self._targets, self._live, self._retired = {}, [], []
            fds, self._fds = self._fds, {}
        for conn in connections:
            conn.close()
        _close_fds([fd for each in fds.values() for fd in each])

    # -- records and returns -------------------------------------------------------------
    def record(self, record: m.DirectRecord) -> None:
        with self._lock:
            self._records.append(record)

    def add_records(self, records: Sequence[m.DirectRecord]) -> None:
        with self._lock:
            self._records += records

    def take_records(self) -> list[m.DirectRecord]:
        """The records not yet sent (for the server, or for a direct caller)."""
        if not self._records:
            return []
        with self._lock:
            records, self._records = self._records, []
        return records

    def flush(self) -> None:
        """Give lent outputs back on connections not in use; close retired ones that hold
        nothing any more."""
        if not self.active or (not self._retired and not any(c.returns for c in self._live)):
            return  # the usual case, told without the lock: nothing to give back
        with self._lock:
            live, retired = self._live, self._retired
        for conn in live:
            if conn.returns:
                self._flush_one(conn, retired=False)
        for conn in retired:
            self._flush_one(conn, retired=True)
        with self._lock:
            self._retired = [c for c in self._retired if not c.closed]

    @staticmethod
    def _flush_one(conn: Connection, retired: bool) -> None:
        """Send what was given back (a retired connection with nothing lent closes); a
        connection in use is left to its call, which carries the returns itself."""
        if not conn.busy.acquire(blocking=False):
            return
        try:
            release = conn.release_frame()
            if release is not None and not conn.closed:
                conn.channel.send(release)
        except OSError:
            conn.close()
        finally:
            conn.busy.release()
        if retired and conn.lent <= 0:
            conn.close()

    # -- a call ---------------------------------------------------------------------------
    def start(
        self, target: Target, conn: Connection, call: CallSpec, refs: list[m.TensorRef],
        payload: list[memoryview], fences: list[m.Fence],
    ) -> DirectCall | None:  # fmt: skip
        """Check the call as the server would (raises DlserveError) and send it, with the
        fences over its GPU inputs (the callee answers with its own: the call is
        ``fenced``); None when the instance is gone (the call goes through the server).
        Either way ``conn`` is let go unless a DirectCall is returned."""
        refs = [self._by_reference(r) if r.where in _BY_REFERENCE else r for r in refs]
        try:
            batch = target.check(call, refs, payload)
        except errors.DlserveError as exc:
            conn.busy.release()
            now = time.monotonic_ns()
            self.record(m.DirectRecord(target.id, now, now, error_code=exc.code.value,
                                       rejected=True))  # fmt: skip
            raise
        if fences:  # the caller's GPU work may be done by now: the callee need not wait
            fences = cuda_peers.unfinished(fences)
        infer = m.Infer(rid=-self._link.next_call_id(), request_id=call.request_id,
                        inputs=refs, outputs=call.outputs, parameters=call.parameters,
                        chain=call.chain, lend=True, fences=fences, fenced=True)  # fmt: skip
        release = conn.release_frame()
        sent = time.monotonic_ns()
        try:
            if release is None:  # the usual: one frame
                conn.channel.send(infer, payload)
            else:
                conn.channel.send_many([(release, ()), (infer, payload)])
        except OSError:  # not delivered: safe to send through the server
            conn.busy.release()
            self.lost(target, conn)
            return None
        except codec.UnencodableFrame as failed:  # nothing was sent: this call fails
            if release is not None:
                conn.returns.extendleft(reversed(release.offsets + [-g for g in release.gpu]))
                conn.lent += len(release.offsets) + len(release.gpu)
            conn.busy.release()
            raise errors.InvalidArgumentError(
                f"BLS call to '{target.model}' cannot be sent: {failed.cause}"
            ) from None
        return DirectCall(self, target, conn, sent, batch)

    def _by_reference(self, ref: m.TensorRef) -> m.TensorRef:
        """This worker's own arenas (``ref`` is in one), as another worker maps them
        (PEER_ARENA)."""
        if not self.arenas[0]:
            return ref
        index = 0 if ref.where == m.Where.INPUT_ARENA else 1
        arena, path = self.arenas[0][index], self.arenas[1][index]
        return msgspec.structs.replace(ref, where=m.Where.PEER_ARENA, region=arena, key=path)


class DirectCall:
    """A call sent on a connection: :meth:`wait` for its answer, then :meth:`done`."""

    def __init__(
        self, calls: DirectCalls, target: Target, conn: Connection, sent_ns: int, batch: int
    ) -> None:
        self.calls, self.target, self.conn = calls, target, conn
        self.sent_ns, self.batch = sent_ns, batch

    def wait(self) -> tuple[m.InferDone, memoryview] | None:
        """The callee's answer; None when it closed the connection without running the
        call (it is stopping: the call goes through the server). Raises WorkerDiedError
        when the instance died."""
        conn = self.conn
        while True:
            try:
                msg, payload = conn.channel.recv()
            except codec.UnreadableFrame as bad:
                unread = self._unreadable(bad)
                if unread is None:
                    continue  # not the answer: it is still to come
                return unread, bad.payload
            except (ChannelClosed, OSError):
                self._give_up()
                raise errors.WorkerDiedError(errors.not_healthy(conn.instance.name)) from None
            except BaseException:  # a broken frame, KeyboardInterrupt: the connection goes
                self._give_up()
                raise
            if isinstance(msg, m.InferDone):
                if msg.direct:  # the callee's own direct calls: forwarded
                    self.calls.add_records(msg.direct)
                return msg, payload
            if isinstance(msg, m.DirectBye):
                self._give_up()
                return None

    def _unreadable(self, bad: codec.UnreadableFrame) -> m.InferDone | None:
        """The callee's answer cannot be read: the call fails (the connection goes on), and
        what the answer lent goes back to the callee. None: ``bad`` was another frame."""
        if bad.kind is not m.InferDone:
            return None
        lent = [ref for ref in bad.fields.get("outputs", []) if ref.where == m.Where.PEER_ARENA
                or (ref.where == m.Where.CUDA_IPC and ref.lend)]  # fmt: skip
        for ref in lent:
            self.conn.give_back(ref.region, ref.offset if ref.lend == 0 else -ref.lend)
        self.conn.lent += len(lent)
        error = (f"model '{self.target.model}' (instance '{self.conn.instance.name}') sent "
                 f"{bad.what}: {bad.cause}")  # fmt: skip
        return m.InferDone(bad.ident or 0, error=error, error_code="internal")

    def _give_up(self) -> None:
        self.conn.busy.release()
        self.calls.lost(self.target, self.conn)
        record = m.DirectRecord(self.target.id, self.sent_ns, time.monotonic_ns(),
                                error_code="unavailable")  # fmt: skip
        self.calls.record(record)

    def done(self, reply: m.InferDone, lent: int) -> None:
        """The answer was read (``lent`` of its outputs are held here): the connection is
        free again, and the call is recorded for the callee's statistics."""
        self.conn.lent += lent
        self.conn.busy.release()
        timings = reply.timings if not reply.error_code else None
        record = m.DirectRecord(self.target.id, self.sent_ns, time.monotonic_ns(), self.batch,
                                timings, reply.error_code)  # fmt: skip
        self.calls.record(record)


def _checked_form(
    model: str, call: CallSpec, refs: list[m.TensorRef], payload: list[memoryview]
) -> InferRequest:
    """The call as the validator reads it: inline inputs with their bytes (one piece of
    ``payload`` each, in order), the others by their size (as the server sees a call whose
    inputs are in another worker's memory)."""
    inputs: list[InputTensor] = []
    pieces = iter(payload)
    for ref in refs:
        shape = tuple(ref.shape)
        if ref.where == m.Where.PAYLOAD:
            inputs.append(InputTensor(ref.name, ref.datatype, shape, next(pieces)))
        else:
            inputs.append(InputTensor(ref.name, ref.datatype, shape, None, {},
                                      RegionRef("", ref.nbytes, 0)))  # fmt: skip
    outputs = [RequestedOutput(name) for name in call.outputs]
    return InferRequest(model, "", call.request_id, inputs, outputs, dict(call.parameters))


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


# -- exec() and async_exec() sent straight to an instance ----------------------------------


def _plain(request: InferenceRequest) -> bool:
    """Nothing in the request needs the server: no timeout, trace or sequence (read off
    its fields: this runs on every call)."""
    return (
        not request._timeout
        and not request._correlation_id
        and not request._flags
        and not isinstance(request._trace, InferenceTrace)
    )


def _device(inputs: list[Tensor]) -> int | None:
    """The GPU of the first GPU input (an instance there is preferred)."""
    for tensor in inputs:
        if tensor._gpu is not None:
            return tensor._gpu.device_id
    return None


def start_direct(
    worker: WorkerLink, request: InferenceRequest
) -> Started | InferenceResponse | None:
    """The call, sent straight to an instance (:meth:`Started.finish` waits for it); its
    response at once when it fails the callee's checks; None: send it through the server."""
    if not request.model_name() or not _plain(request):
        return None
    chain = [*worker.upstream, worker.instance]  # this instance waits for the callee
    target = worker.direct.target(request.model_name(), int(request.model_version()))
    if target is None:
        return None
    conn = target.take(_device(request.inputs()), chain)
    if conn is None:  # every instance not upstream is busy with this worker's calls (the
        return None  # server queues it), or none is left (the server says so)
    devices: set[int] = set()  # of GPU inputs: fenced, not waited for
    try:
        refs, payload = encode_inputs(request.inputs(), worker.memory, devices)
        fences = cuda_peers.fences(devices) if devices else []
    except BaseException:
        conn.busy.release()
        raise
    staged = [r.offset for r in refs if r.where == m.Where.OUTPUT_ARENA]
    params = request.parameters()
    spec = CallSpec(request.request_id(), request.requested_output_names(),
                    json.loads(params) if params != "{}" else {}, chain)  # fmt: skip
    try:
        call = worker.direct.start(target, conn, spec, refs, payload, fences)
    except errors.DlserveError as exc:  # the callee's checks
        _unstage(worker, staged)
        return _error_response(exc)
    if call is None:
        _unstage(worker, staged)
        return None
    return Started(worker, call, request.inputs(), staged)


class Started:
    """A call sent straight to an instance; its inputs stay alive until it is answered."""

    def __init__(
        self, worker: WorkerLink, call: DirectCall, inputs: list[Tensor], staged: list[int]
    ) -> None:
        self.worker, self.call = worker, call
        self.inputs = inputs  # the callee may read the caller's memory until it answers
        self.staged = staged  # copies in this worker's output arena, freed once answered

    def finish(self) -> InferenceResponse | None:
        """Wait for the answer: the response, or None when the instance did not run the
        call (it was stopping: send it through the server)."""
        failed = None
        try:
            answer = self.call.wait()
            if answer is not None and answer[0].fences:
                failed = _follow(answer[0].fences)  # before the inputs may go
        except errors.DlserveError as exc:
            return _error_response(exc)
        finally:
            _unstage(self.worker, self.staged)
            self.inputs = []
        if answer is None:
            return None
        done, payload = answer
        try:
            answered = response(self.worker, done, payload, self.call.conn.give_back)
            if failed is not None:  # its lent outputs go back as ``answered`` goes
                return _failed_response(failed, TritonError.INTERNAL)
            return answered
        finally:
            self.call.done(done, lent_count(done))


def _follow(fences: list[m.Fence]) -> str | None:
    """The callee's GPU work was not waited for: this worker's next work on the GPU (its
    inputs' memory reused, the outputs read) is queued after it, so the outputs are ready
    on the legacy stream. The error's message when that cannot be done."""
    try:
        cuda_peers.wait_fences(fences, on_cpu=False)
    except TritonModelException as exc:
        return str(exc)
    return None


def _unstage(worker: WorkerLink, staged: list[int]) -> None:
    if staged and worker.memory is not None:
        for offset in staged:
            worker.memory.unstage(offset)


def _error_response(exc: errors.DlserveError) -> InferenceResponse:
    return _failed_response(exc.message, triton_code(exc.code.value))


def _failed_response(message: str, code: int) -> InferenceResponse:
    return InferenceResponse(error=TritonError(message, code))
