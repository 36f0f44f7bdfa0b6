"""BLS calls from one worker straight to another: what the server does for them.

A BLS call through the server costs two extra messages, a scheduler pass and the server's
Python both ways (docs/benchmarks.md has what that costs). A caller may instead call a
plain callee's instances itself (``worker/bls/direct_caller.py``; the callee's side is
``worker/bls/direct_callee.py``): it asks once per model (``DirectOpen``), and the server
answers with the callee's tensors and instances and hands each instance one end of a new
socketpair and the caller the other (descriptors beside the frames).
From then on the server only hears of those calls afterwards, for the callee's
statistics (records in the caller's next ``InferDone``, or a ``DirectStats`` frame
ahead of another reply), and when the callee maps a client's region for one
(``DirectMapped``: it is told to unmap it when the region goes).

Only plain callees are called directly: no dynamic or sequence batching (the server's
queue gathers or orders their requests), not decoupled, no response cache, no ensemble,
no reshape. The others, and calls with a timeout or a trace, go through the server. When
a model is loaded, reloaded or unloaded, the workers that asked about it are told
(``DirectStale``) and ask again at their next call; an instance that stops says goodbye
on its connections, and calls it had not run go through the server.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import weakref
from typing import TYPE_CHECKING

from dlserve import errors
from dlserve.ipc import messages as m
from dlserve.server.core.instances.handle import DirectMessage, WorkerHandle
from dlserve.server.core.models.versions import ModelVersion
from dlserve.tensors.validation import TensorSpec

if TYPE_CHECKING:
    from dlserve.server.core.service import InferenceService


def refusal(loaded: ModelVersion) -> str:
    """Why ``loaded`` cannot be called directly ("" when it can)."""
    config = loaded.config
    if loaded.pool is None:
        return "an ensemble runs in the server"
    if loaded.decoupled:
        return "a decoupled model's responses stream through the server"
    if config.HasField("dynamic_batching"):
        return "the server's queue gathers its requests into batches"
    if config.HasField("sequence_batching"):
        return "the server orders its sequences"
    if loaded.cache is not None:
        return "the server answers from its response cache"
    if loaded.validator.reshapes:
        return "the server reshapes its tensors"
    return ""


def _specs(specs: dict[str, TensorSpec]) -> list[m.DirectSpec]:
    return [m.DirectSpec(s.name, s.dtype.wire, list(s.dims), s.optional) for s in specs.values()]


class DirectLinks:
    """The server's side of direct BLS calls (``server/core/calls/bls_router.py`` hands it the
    frames)."""

    def __init__(self, service: InferenceService) -> None:
        self.service = service
        self.enabled = True  # --bls-direct
        self._ids = itertools.count(1)
        self._versions: weakref.WeakValueDictionary[int, ModelVersion] = (
            weakref.WeakValueDictionary()
        )
        self._target_ids: weakref.WeakKeyDictionary[ModelVersion, int] = weakref.WeakKeyDictionary()
        self._askers: dict[str, weakref.WeakSet[WorkerHandle]] = {}  # by model name

    def on_frame(self, worker: WorkerHandle, msg: DirectMessage) -> None:
        if isinstance(msg, m.DirectOpen):
            self._open(worker, msg)
        elif isinstance(msg, m.DirectStats):
            # after what this loop turn has woken (the reply that carried them, on the
            # critical path), still before it reads anything more: a client that has its
            # response and asks for statistics then is answered after they are counted
            asyncio.get_running_loop().call_soon(self._record, msg.records)
        else:
            self._bind(worker, msg.regions)

    # -- opening ------------------------------------------------------------------------
    def _open(self, caller: WorkerHandle, msg: m.DirectOpen) -> None:
        if not self.enabled:
            off = m.DirectTargets(msg.call, error="--bls-direct is false", lasting=True)
            caller.send_answer(off, [])
            return
        self._askers.setdefault(msg.model_name, weakref.WeakSet()).add(caller)
        version = "" if msg.model_version < 0 else str(msg.model_version)
        try:
            loaded = self.service.version(msg.model_name, version)
        except errors.DlserveError as exc:
            caller.send_answer(m.DirectTargets(msg.call, error=exc.message), [])
            return
        reason = refusal(loaded)
        if reason:
            caller.send_answer(m.DirectTargets(msg.call, error=reason, lasting=True), [])
            return
        assert loaded.pool is not None
        instances: list[m.DirectInstance] = []
        caller_ends: list[socket.socket] = []
        callee_ends: list[socket.socket] = []
        try:
            for spec, callee in zip(loaded.pool.specs, loaded.pool.workers, strict=True):
                if callee is None or not callee.alive:
                    continue
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                callee_ends.append(theirs)
                accept = m.DirectAccept(list(callee.arena_ids), list(callee.arena_paths))
                if callee.send_with_fds(accept, [theirs.fileno()]):
                    device = spec.device_id if spec.kind == "GPU" else -1
                    instances.append(m.DirectInstance(spec.name, device))
                    caller_ends.append(ours)
                else:
                    ours.close()
            self._send_targets(caller, msg, loaded, instances, caller_ends)
        finally:  # the workers have their own copies now
            for end in caller_ends + callee_ends:
                end.close()

    def _send_targets(
        self, caller: WorkerHandle, msg: m.DirectOpen, loaded: ModelVersion,
        instances: list[m.DirectInstance], caller_ends: list[socket.socket],
    ) -> None:  # fmt: skip
        if not instances:
            caller.send_answer(m.DirectTargets(msg.call, error="no instance is ready"), [])
            return
        validator = loaded.validator
        targets = m.DirectTargets(
            msg.call, self._target_id(loaded), model_version=loaded.version,
            max_batch_size=validator.max_batch_size, inputs=_specs(validator.inputs),
            outputs=_specs(validator.outputs), instances=instances,
            arena_ids=list(caller.arena_ids), arena_paths=list(caller.arena_paths),
        )  # fmt: skip
        if not caller.send_with_fds(targets, [end.fileno() for end in caller_ends]):
            caller.send_answer(m.DirectTargets(msg.call, error="the caller is not reading"), [])

    def _target_id(self, loaded: ModelVersion) -> int:
        found = self._target_ids.get(loaded)
        if found is None:
            found = self._target_ids[loaded] = next(self._ids)
            self._versions[found] = loaded
        return found

    def changed(self, model_name: str) -> None:
        """``model_name`` was (re)loaded or unloaded: the workers that asked about it ask
        again at their next call."""
        askers = self._askers.pop(model_name, None)
        for worker in list(askers or ()):
            worker.tell(m.DirectStale(model_name))

    # -- afterwards ---------------------------------------------------------------------
    def _record(self, records: list[m.DirectRecord]) -> None:
        """Direct calls done: the callee's statistics, as if the server had run them."""
        for record in records:
            loaded = self._versions.get(record.target)
            if loaded is None:
                continue  # its version is gone meanwhile
            stats, t = loaded.stats, record.timings
            total = record.done_ns - record.sent_ns
            if t is None:  # as the server counts it: REJECTED by its checks, else BACKEND
                stats.record_failure(total, "REJECTED" if record.rejected else "BACKEND")
                continue
            infer, compute_input = t.infer_end - t.infer_start, t.infer_start - t.input_start
            compute_output = record.done_ns - t.infer_end
            stats.record_request(record.batch, total, t.input_start - record.sent_ns,
                                 compute_input, infer, compute_output)  # fmt: skip
            stats.record_execution(record.batch, compute_input, infer, t.output_end - t.infer_end)

    def _bind(self, worker: WorkerHandle, regions: list[int]) -> None:
        """``worker`` mapped these regions for a direct call: told to unmap them when they
        go (now, for one that is gone already)."""
        gone = self.service.regions.bind(regions, worker)
        if gone:
            worker.unmap_regions(gone)
