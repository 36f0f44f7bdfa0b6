"""``exec()`` / ``async_exec()`` sent straight to an instance of the callee, not through
the server, where that can be done (``direct.py`` keeps the connections; the server's
side is ``server/core/calls/direct_broker.py``).

A call goes direct when it has no timeout, no trace, no sequence id or flags, is not
decoupled, and the server says the callee may be called so; and when one of the
callee's instances that is not upstream of this call (in its call chain: it waits for
this call) is free on this worker's connections. Everything else, and a call the callee
did not run because it was stopping, goes through the server as before (which refuses
a call whose chain holds every instance of the callee, with its message).
"""

from __future__ import annotations

import json

from dlserve import errors
from dlserve.ipc import messages as m
from dlserve.pb_utils.exceptions import TritonError, TritonModelException
from dlserve.pb_utils.request import InferenceRequest, InferenceResponse, InferenceTrace
from dlserve.pb_utils.tensor import Tensor
from dlserve.worker.bls import cuda_peers
from dlserve.worker.bls.direct_caller import CallSpec, DirectCall
from dlserve.worker.bls.tensors import encode_inputs, lent_count, response, triton_code
from dlserve.worker.link import link


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


def start_direct(request: InferenceRequest) -> Started | InferenceResponse | None:
    """The call, sent straight to an instance (:meth:`Started.finish` waits for it); its
    response at once when it fails the callee's checks; None: send it through the server."""
    worker = link.current()
    if worker is None or not request.model_name() or not _plain(request):
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
        self, worker: link.WorkerLink, call: DirectCall, inputs: list[Tensor], staged: list[int]
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


def _unstage(worker: link.WorkerLink, staged: list[int]) -> None:
    if staged and worker.memory is not None:
        for offset in staged:
            worker.memory.unstage(offset)


def _error_response(exc: errors.DlserveError) -> InferenceResponse:
    return _failed_response(exc.message, triton_code(exc.code.value))


def _failed_response(message: str, code: int) -> InferenceResponse:
    return InferenceResponse(error=TritonError(message, code))
