"""Requests other workers send straight to this instance (direct BLS calls: the callee's
side; ``worker/bls/direct_callee.py`` keeps the connections). The serve loop runs them as it
runs the server's, and answers on the connection they came on."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.worker.bls import cuda_peers
from dlserve.worker.bls.direct_callee import Served
from dlserve.worker.link import frames
from dlserve.worker.link.link import WorkerLink
from dlserve.worker.runner import ModelRunner

_REGIONS = (m.Where.CLIENT_REGION, m.Where.CUDA_REGION)


def serve_direct(
    runner: ModelRunner, worker: WorkerLink, conn: Served, msg: m.ServerToWorker,
    payload: memoryview,
) -> None:  # fmt: skip
    """Handle one frame from a direct caller: a request (run now, answered on ``conn``) or
    outputs it gives back."""
    if type(msg) is m.Infer:
        conn.given_back(msg.release)  # the runner frees them
        done, buffers = _answer(runner, worker, conn, msg, payload)
        if done.fences:  # the model's GPU work may be done by now: the caller need not wait
            done.fences = cuda_peers.unfinished(done.fences)
        if not done.deferred:  # deferred: the response goes when the model sends it
            try:
                _reply(worker, conn, done, buffers, runner)
            except OSError:  # the caller is gone: what it was lent goes back
                worker.served.lost(conn, runner.release)
        _tell_mapped(worker, msg)
    elif isinstance(msg, m.Release):
        runner.release(msg.offsets, msg.gpu)
        conn.given_back(msg.offsets, msg.gpu)


def _reply(
    worker: WorkerLink, conn: Served, done: m.InferDone, buffers: Sequence[bytes | memoryview],
    runner: ModelRunner,
) -> None:  # fmt: skip
    """Send the answer; one that cannot be encoded goes with its text made UTF-8, else as
    the request's error (what it lent is given back first: the caller never holds it)."""
    for _ in range(2):
        try:
            conn.channel.send(done, buffers)
            return
        except codec.UnencodableFrame as failed:
            substitute = frames.sendable(failed, worker.model_name, None)
            assert isinstance(substitute, m.InferDone)
            if substitute.outputs is not done.outputs:  # an error: its outputs go back
                lent = [ref.offset for ref in done.outputs if ref.where == m.Where.PEER_ARENA]
                gpu = frames.arena_outputs(done.outputs)[1]
                conn.given_back(lent, gpu)
                runner.release(lent, gpu)
            done = substitute
    conn.channel.send(done, buffers)


def _answer(
    runner: ModelRunner, worker: WorkerLink, conn: Served, msg: m.Infer, payload: memoryview
) -> tuple[m.InferDone, Sequence[bytes | memoryview]]:
    reply = runner.infer(msg, payload, functools.partial(_send_late, runner, worker, conn))
    if reply is None:  # decoupled: the server never offers such a model for direct calls
        done = m.InferDone(msg.rid, error="a decoupled model was called directly",
                           error_code="internal")  # fmt: skip
        reply = done, []
    done, buffers = reply
    done.outputs = [worker.served.lent_ref(conn, ref) for ref in done.outputs]
    if not done.deferred:  # (not sent: they ride with a later frame)
        done.direct = worker.direct.take_records()  # its own direct calls: the caller forwards
    return done, buffers


def _send_late(
    runner: ModelRunner, worker: WorkerLink, conn: Served, done: m.InferDone,
    buffers: list[memoryview],
) -> None:  # fmt: skip
    """A response the model sent after its ``execute`` returned (from any thread of it):
    the caller, which has this connection to itself until it is answered, reads it there."""
    done.outputs = [worker.served.lent_ref(conn, ref) for ref in done.outputs]
    try:
        _reply(worker, conn, done, buffers, runner)
    except OSError:  # the caller is gone (its connection may be dropped already): ours back
        offsets = [ref.offset for ref in done.outputs if ref.where == m.Where.PEER_ARENA]
        lent = [ref.lend for ref in done.outputs if ref.where == m.Where.CUDA_IPC and ref.lend]
        conn.given_back(offsets, lent)
        runner.release(offsets, lent)


def _tell_mapped(worker: WorkerLink, msg: m.Infer) -> None:
    """The client regions this request had mapped here, the first time: the server tells
    this worker to unmap them when they go (it did not see this request)."""
    told = worker.served.told
    new = [ref.region for ref in msg.inputs if ref.where in _REGIONS and ref.region not in told]
    if new:
        told.update(new)
        worker.send(m.DirectMapped(sorted(set(new))))
