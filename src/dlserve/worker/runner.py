"""Runs one model instance inside a worker: load, execute, finalize.

Inputs become numpy views of the bytes the server delivered (the frame's
payload, or the input arena) or of a client's shared-memory region; outputs go
back inline when small, through this worker's output arena, or straight into
the client region the request names for them. The runner owns its collaborators:
the input reader (``inputs.py``), the output writer (``outputs.py``), the requests
cancels find (``cancellation.py``), the memory BLS calls pass by reference
(``bls/memory.py``) and the answers of senders (``answers.py``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import time
import traceback
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from dlserve import pb_utils as pb_utils
from dlserve.ipc import messages as m
from dlserve.pb_utils.exceptions import TritonError
from dlserve.tensors.arena import Arena, ShmSegment
from dlserve.worker import gpu_io, rescheduling
from dlserve.worker.answers import Answers, Deferred, Execute, Route
from dlserve.worker.bls import cuda_peers
from dlserve.worker.bls import gpu_lending as gpu_bls
from dlserve.worker.bls.memory import SharedMemoryForBls
from dlserve.worker.bls.peers import PeerArenas
from dlserve.worker.cancellation import Cancellation, upstream
from dlserve.worker.client_regions import ClientRegions
from dlserve.worker.decoupled import decoupled_execute
from dlserve.worker.event_loop import ModelLoop
from dlserve.worker.failures import describe_exception, error_reply, execute_failure
from dlserve.worker.inputs import InputReader
from dlserve.worker.link import link
from dlserve.worker.model_file import import_model_file
from dlserve.worker.outputs import OutputWriter

Item = m.Infer | m.BatchItem  # one request: alone, or in a batch
_NONE: frozenset[int] = frozenset()  # no request deferred
_NO_TARGETS: dict[str, m.TensorRef] = {}  # a request that names no output region


class LoadError(Exception):
    """model.py could not be imported, auto-completed or initialized."""


class ModelRunner:
    """One instance of one model."""

    def __init__(self, load: m.Load, arenas: tuple[ShmSegment, ShmSegment]) -> None:
        """``arenas``: the input arena (the server writes) and the output arena (we write)."""
        self.load = load
        self.config: dict[str, Any] = json.loads(load.config_json)
        self.model: Any = None
        self.model_class: Any = None
        self.model_loop = ModelLoop(lambda: self.link)  # for async def methods of the model
        self.input_arena, self.output_segment = arenas
        self.output_arena = Arena(self.output_segment)
        self.regions = ClientRegions()
        self.peers = PeerArenas()
        self.gpu_lender = gpu_bls.GpuLender()
        self.gpu = gpu_io.GpuIO(gpu_io.Placement.AS_ARRIVED, 0, self.regions, self.output_arena)
        self.device_uuid = ""
        self.inputs = InputReader(self.gpu, self.regions, self.peers, self.input_arena)
        self.outputs = OutputWriter(self.regions, self.output_arena, self.gpu, self.gpu_lender)
        # get_output_buffer of a request that names no output region (the usual): one for all
        self._untargeted_buffer = functools.partial(self.outputs.buffer, _NO_TARGETS)
        self.bls_memory = SharedMemoryForBls(
            self.regions, self.peers, self.input_arena, self.output_arena
        )
        self.cancellation = Cancellation()
        # responses sent through senders (not decoupled), and where they go after the return
        self.answers = Answers(self.outputs, self.cancellation.executing, self.instance_name)
        self._to_server: Route = self._late
        self._decoupled: bool | None = None  # from the config, once known
        self._iterative: bool | None = None  # likewise: may requests be rescheduled?
        self.link: link.WorkerLink | None = None  # the serve loop's, once loaded by it

    # -- loading ------------------------------------------------------------------------
    @property
    def decoupled(self) -> bool:
        if self._decoupled is None:
            self._decoupled = pb_utils.using_decoupled_model_transaction_policy(self.config)
        return self._decoupled

    @property
    def iterative(self) -> bool:
        if self._iterative is None:
            self._iterative = rescheduling.iterative(self.config)
        return self._iterative

    def instance_name(self) -> str:
        """This instance as Triton's messages name it."""
        return self.load.instance_name or self.load.model_name

    def update(self, load: m.Load) -> None:
        """A second Load on the same worker: the final config and this instance's identity."""
        self.load = load
        self.config = json.loads(load.config_json)
        self._decoupled = self._iterative = None

    def start(self) -> None:
        """Import, auto-complete and initialize; raises LoadError with the reason."""
        load = self.load
        try:
            if self.model_class is None:
                module = import_model_file(load.model_file)
                self.model_class = module.TritonPythonModel
            if load.autocomplete and hasattr(self.model_class, "auto_complete_config"):
                self.config = self._auto_complete(self.model_class)
            if load.initialize:
                self._bind_device()
                self.model = self.model_class()
                if hasattr(self.model, "initialize"):
                    self._call(self.model.initialize, self.initialize_args())
        except LoadError:
            raise
        except BaseException as exc:
            raise LoadError(describe_exception(exc)) from exc

    def _bind_device(self) -> None:
        """Input placement from the config; a GPU instance's device made current."""
        load = self.load
        try:
            placement = gpu_io.placement_of(self.config, load.instance_kind)
        except ValueError as exc:
            raise LoadError(str(exc)) from None
        self.gpu = self.inputs.gpu = self.outputs.gpu = gpu_io.GpuIO(
            placement, load.device_id, self.regions, self.output_arena
        )
        pb_utils.gpu.model_name = load.model_name
        if load.instance_kind == "GPU":
            try:
                self.device_uuid = gpu_io.bind_device(load.device_id)
            except ValueError as exc:
                raise LoadError(str(exc)) from None

    def _auto_complete(self, model_class: Any) -> dict[str, Any]:
        from dlserve.pb_utils.model_config import ModelConfig

        completed = model_class.auto_complete_config(ModelConfig(self.config))
        if not isinstance(completed, ModelConfig):
            raise LoadError(
                f"auto_complete_config function in model '{self.load.model_name}' must return "
                "a valid pb.ModelConfig object."
            )
        # as Triton's stub, through JSON: what JSON cannot hold (a bytes name, say) fails
        # the load here with json's TypeError, not the Loaded frame that carries the config
        completed_config: dict[str, Any] = json.loads(json.dumps(completed.as_dict()))
        return completed_config

    def initialize_args(self) -> dict[str, str]:
        load = self.load
        return {
            "model_config": json.dumps(self.config),
            "model_instance_kind": load.instance_kind,
            "model_instance_name": load.instance_name,
            "model_instance_device_id": str(load.device_id),
            "model_instance_device_uuid": self.device_uuid,
            "model_repository": load.model_path,
            "model_version": str(load.model_version),
            "model_name": load.model_name,
        }

    def _call(self, function: Any, *args: Any) -> Any:
        """Call a method of the model; a coroutine (``async def``) runs on the instance's
        event loop, which lives on after it (tasks it started keep running)."""
        result = function(*args)
        if type(result) is list or result is None:  # the usual answers: nothing to await
            return result
        if inspect.isawaitable(result):
            result = self.model_loop.run(result)
        return result

    # -- inference ----------------------------------------------------------------------
    def infer(
        self, msg: m.Infer, payload: memoryview, route: Route | None = None
    ) -> tuple[m.InferDone, list[memoryview]] | None:
        """Run one request: the reply to send, or None for a decoupled model (its responses
        go out through the request's response sender). ``route``: where a response sent
        after ``execute`` returned goes (None: the server)."""
        replies = self.execute([msg], msg.release, payload, route)
        return replies[0] if replies else None

    def execute(
        self, items: Sequence[Item], release: Sequence[int], payload: memoryview,
        route: Route | None = None,
    ) -> list[tuple[m.InferDone, list[memoryview]]]:  # fmt: skip
        """One ``execute(requests)`` call for ``items``: one reply each, in their order.

        As Triton's Python backend does, the model gets one InferenceRequest per item
        (nothing is concatenated) and returns one response per request, or sends it with
        the request's response sender (then the reply may be a ``deferred`` notice, and
        the response follows through ``route``). A decoupled model's requests answer
        through their response senders (no reply here). A request cancelled while it
        waited is not run.
        """
        timings_start = time.monotonic_ns()
        if release:
            self.release(release)
        worker = self.link if self.link is not None else link.current()
        if worker is not None:  # cancels read ahead behind these are dispatched first
            worker.poll(buffered_only=True)  # (no system call)
        cancelled, items = self.cancellation.start(items)
        answered = self._answer_cancelled(cancelled, worker) if cancelled else []
        if worker is not None:
            worker.upstream = upstream(items)
        if self.decoupled:
            assert worker is not None, "a decoupled model needs the worker's link"
            decoupled_execute(self, worker, items, payload, timings_start)
            return answered
        replies: list[tuple[m.InferDone, list[memoryview]] | None] = [None] * len(items)
        requests: list[pb_utils.InferenceRequest] = []
        running: list[int] = []
        deferred: AbstractSet[int] = _NONE
        executing = self.cancellation.executing
        try:
            for index, item in enumerate(items):
                try:
                    request = self.request(item, payload)
                except BaseException as exc:  # this request alone fails
                    replies[index] = error_reply(item.rid, exc), []
                    continue
                requests.append(request)
                running.append(index)
                executing[item.rid] = request
                if worker is not None:
                    request._poll = worker.poll
            if requests:
                ran = items if len(running) == len(items) else [items[i] for i in running]
                execute = self.answers.prepare(
                    requests, ran, timings_start, route or self._to_server
                )
                deferred = self._execute(ran, running, requests, replies, execute)
        finally:
            for item in items:
                if item.rid not in deferred:  # a deferred one executes until its response
                    executing.pop(item.rid, None)
            self.outputs.drop_buffers()
        return answered + [r for r in replies if r is not None]

    def _answer_cancelled(
        self, items: Sequence[Item], worker: link.WorkerLink | None
    ) -> list[tuple[m.InferDone, list[memoryview]]]:
        """Requests cancelled while they waited: answered here, not run (a decoupled
        model's through the link, as its responses go)."""
        replies: list[tuple[m.InferDone, list[memoryview]]] = []
        for item in items:
            error = TritonError("Request was cancelled", TritonError.CANCELLED)
            if self.decoupled and worker is not None:
                worker.send(m.StreamResponse(item.rid, final=True, error=error.message(),
                                             error_code="cancelled"))  # fmt: skip
            else:
                replies.append((error_reply(item.rid, error), []))
        return replies

    def _late(self, done: m.InferDone, buffers: list[memoryview]) -> None:
        """A response sent after its ``execute`` returned, to the server."""
        worker = self.link if self.link is not None else link.current()
        if worker is not None:
            worker.send(done, buffers)

    def _execute(
        self,
        ran: Sequence[Item],
        running: list[int],
        requests: list[pb_utils.InferenceRequest],
        replies: list[tuple[m.InferDone, list[memoryview]] | None],
        execute: Execute,
    ) -> AbstractSet[int]:
        """Call the model's execute for ``requests`` (of ``ran``, at ``running`` in
        ``replies``) and fill in their replies; the rids whose responses come later."""
        infer_start = execute.infer_start = time.monotonic_ns()
        try:
            responses = self._call(self.model.execute, requests)
            infer_end = time.monotonic_ns()
            checked = rescheduling.checked_responses(responses, requests)
            if self.answers.taken():
                for item, response in zip(ran, checked, strict=True):
                    if response is not None:
                        self.answers.count_returned(item.rid)
            settled = gpu_bls.settle_borrowed(ran)
        except BaseException as exc:  # the model's failure is every request's failure
            self._failed(ran, running, replies, execute_failure(self.load.instance_name, exc))
            execute.returned = True
            return _NONE
        execute.returned = True
        deferred: AbstractSet[int] = _NONE
        for index, item, response, request in zip(running, ran, checked, requests, strict=True):
            if response is not None and request._release_flags != rescheduling.RESCHEDULE:
                replies[index] = self._answer(item, response, settled)  # the usual
                continue
            replies[index] = reply = self._outcome(item, response, request, settled)
            if reply[0].deferred:
                deferred = {*deferred, item.rid}
        if self.answers.taken():
            self.answers.finish([item.rid for item in ran if item.rid not in deferred])
        timings = m.Timings(execute.start, infer_start, infer_end, time.monotonic_ns())
        for index in running:
            done = replies[index]
            if done is not None and not done[0].error_code:
                done[0].timings = timings
        return deferred

    def _outcome(
        self, item: Item, response: pb_utils.InferenceResponse | None,
        request: pb_utils.InferenceRequest, settled: AbstractSet[int],
    ) -> tuple[m.InferDone, list[memoryview]]:  # fmt: skip
        """A request's reply once ``execute`` returned ``response`` in its place (None: its
        sender answers it, or nothing does)."""
        try:
            if request._release_flags == rescheduling.RESCHEDULE:
                return rescheduling.rescheduled_reply(item.rid, response), []
            answer = response if response is not None else self.answers.returned(item.rid)
        except BaseException as exc:
            return error_reply(item.rid, exc), []
        if answer is Deferred.LATER:
            return m.InferDone(item.rid, deferred=True), []
        return self._answer(item, answer, settled)

    def _answer(
        self, item: Item, response: pb_utils.InferenceResponse, settled: AbstractSet[int],
        fenced: bool = True,
    ) -> tuple[m.InferDone, list[memoryview]]:  # fmt: skip
        """The reply for ``item`` with the model's response (or its error). ``fenced``:
        a fenced direct call's reply carries fences (False: its GPU work was waited for)."""
        fenced = fenced and gpu_bls.is_fenced(item)
        try:
            error = response.error()
            if error is not None:
                raise error
            if fenced:  # a direct call: fences, not waits
                fences = gpu_bls.reply_fences(item, response)
                reply = self.outputs.reply(item, response, cuda_peers.EVERY_DEVICE)
                reply[0].fences = fences
                return reply
            return self.outputs.reply(item, response, settled)
        except BaseException as exc:
            if fenced:  # the caller finds its memory as it waits
                with contextlib.suppress(pb_utils.TritonModelException):
                    gpu_bls.settle_borrowed([item], every=True)
            return error_reply(item.rid, exc), []

    def _failed(
        self, ran: Sequence[Item], running: list[int],
        replies: list[tuple[m.InferDone, list[memoryview]] | None], exc: BaseException,
    ) -> None:  # fmt: skip
        """``execute`` raised (or returned what it may not): every request fails with it,
        but one whose response was sent before stands (as in Triton)."""
        settled: AbstractSet[int] = frozenset()
        with contextlib.suppress(pb_utils.TritonModelException):  # its GPU work too
            settled = gpu_bls.settle_borrowed(ran, every=True)
        for index, item in zip(running, ran, strict=True):
            sent = self.answers.close(item.rid)
            if sent is not None:
                replies[index] = self._answer(item, sent, settled, fenced=False)
            else:
                replies[index] = error_reply(item.rid, exc), []

    def request(self, msg: Item, payload: memoryview) -> pb_utils.InferenceRequest:
        """The InferenceRequest the model gets for ``msg``; raises if it cannot be made."""
        if type(msg) is m.Infer and msg.fences:  # a direct caller's GPU work, not waited
            # for: waited for here, on the CPU, so that the model finds its inputs ready on
            # any stream, as always (by the time the call arrives it is usually done)
            cuda_peers.wait_fences(msg.fences, on_cpu=True)
        inputs = [self.inputs.tensor(ref, payload) for ref in msg.inputs]
        request = pb_utils.InferenceRequest._received(
            self.load.model_name, inputs, msg.outputs, msg.request_id, msg.parameters
        )
        if msg.flags or msg.correlation_id:  # a sequence's request
            request._correlation_id, request._flags = msg.correlation_id, msg.flags
        if msg.trace_id:
            request._trace = pb_utils.InferenceTrace(msg.trace_id)
        request._timeout = msg.timeout_us  # Triton's request.timeout(): microseconds
        if self.iterative:
            request._reschedulable = True
        if msg.output_regions:
            targets = {t.name: t for t in msg.output_regions}
            request._output_buffer = functools.partial(self.outputs.buffer, targets)  # type: ignore[attr-defined]
        else:
            request._output_buffer = self._untargeted_buffer  # type: ignore[attr-defined]
        return request

    def unmap_regions(self, regions: list[int]) -> None:
        """Client regions the server has unregistered: unmapped here."""
        self.regions.unmap(regions)

    def drop_arenas(self, arenas: list[int]) -> None:
        """Other workers' arenas mapped here (BLS) whose workers are gone."""
        self.peers.drop(arenas)

    def release(self, offsets: Sequence[int], gpu: Sequence[int] = ()) -> None:
        """Output-arena space the server is done with; ``gpu``: lent GPU outputs given back."""
        for offset in offsets:
            self.output_arena.free(offset)
        if gpu:
            self.gpu_lender.give_back(list(gpu))

    # -- shutdown -----------------------------------------------------------------------
    def finalize(self) -> None:
        if self.model is not None and hasattr(self.model, "finalize"):
            try:
                self._call(self.model.finalize)
            except Exception:
                traceback.print_exc()
        self.model_loop.close()  # what the model's coroutines still run is cancelled
        self.answers.stop()
        self.regions.close()
        self.peers.close()
        self.output_segment.close()
        self.input_arena.close()
