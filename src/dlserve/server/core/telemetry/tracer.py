"""Triton's request tracing ("triton" trace mode): which requests are traced, what a
trace holds, and when it is written (as its server's ``src/tracer.cc`` does it).

A request is traced when its model's setting (``server/core/telemetry/trace_settings.py``) samples
it: every ``rate``-th request the frontends ask about, while the setting has traces left. The
frontends ask only while ``Tracer.active`` is true, so with tracing off a request costs one
attribute check per layer. A :class:`Trace` collects timestamps (CLOCK_MONOTONIC nanoseconds,
Triton's steady clock, the worker's clock too) and, at level TENSORS, the tensors; an ensemble step
or a BLS call made with ``trace=request.trace()`` gets a child trace (its own id, ``parent_id`` the
parent's) in the same group. A group is done when its root and every child are released; its JSON
then joins its setting's pending traces, which are written:

- to ``<file>.<n>`` (n counting from 0) each time ``log_frequency`` traces are pending,
  or when ``count`` traces have been taken and every request sampled is done;
- else when the setting is retired (replaced by an update, or the server stops): to
  ``<file>.<n>`` with a ``log_frequency``, otherwise appended to ``<file>``, one JSON
  array that is closed when the server stops.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import IO, Any, Final

from dlserve.server.core.instances.replies import WorkerReply
from dlserve.server.core.telemetry.trace_format import tensor_entry
from dlserve.server.core.telemetry.trace_settings import Setting, TraceSettings
from dlserve.types import InferRequest, OutputTensor

log = logging.getLogger("dlserve")

_JSON: Final = json.JSONEncoder(separators=(",", ":"))


def _string(text: str) -> str:
    return _JSON.encode(text)


class TraceFile:
    """The trace file: one JSON array appended to until the server stops, and the
    numbered files ``<path>.<n>``, each a JSON array of its own."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.index = 0  # the next numbered file
        self._out: IO[str] | None = None

    def save(self, text: str, numbered: bool) -> None:
        try:
            if numbered:
                name = f"{self.path}.{self.index}"
                self.index += 1
                with open(name, "w", encoding="utf-8") as out:
                    out.write(f"[{text}]")
                return
            if self._out is None:
                self._out = open(self.path, "w", encoding="utf-8")  # noqa: SIM115
                self._out.write("[")
            else:
                self._out.write(",")
            self._out.write(text)
            self._out.flush()
        except OSError as exc:
            log.error("failed creating trace file: %s", exc)

    def close(self) -> None:
        if self._out is not None:
            self._out.write("]")
            self._out.close()
            self._out = None


class _Group:
    """A traced request and its children: written together, when all are done."""

    __slots__ = ("open", "setting", "traces")

    def __init__(self, setting: Setting) -> None:
        self.setting = setting
        self.traces: list[Trace] = []
        self.open = 0


class Trace:
    """One traced request (or an ensemble step, or a BLS call, under its parent)."""

    __slots__ = ("_group", "_tracer", "entries", "id", "model_name", "model_version",
                 "parent_id", "request_id", "stamps", "tensors", "timestamps")  # fmt: skip

    def __init__(self, tracer: Tracer, group: _Group, model_name: str, parent_id: int) -> None:
        self._tracer, self._group = tracer, group
        self.id = tracer.next_id()
        self.parent_id = parent_id
        self.model_name, self.model_version, self.request_id = model_name, -1, ""
        self.timestamps = group.setting.timestamps
        self.tensors = group.setting.tensors
        self.stamps: list[tuple[str, int]] = []  # timestamps: name, ns
        self.entries: list[dict[str, Any]] = []  # tensors
        group.traces.append(self)
        group.open += 1
        tracer.live[self.id] = self

    def stamp(self, name: str, ns: int) -> None:
        if self.timestamps:
            self.stamps.append((name, ns))

    def child(self, model_name: str) -> Trace:
        """The trace of a request this one makes (an ensemble step, a BLS call)."""
        return Trace(self._tracer, self._group, model_name, self.id)

    # -- what the core reports ------------------------------------------------------------
    def started(self, model_name: str, version: int, request_id: str, ns: int) -> None:
        self.model_name, self.model_version, self.request_id = model_name, version, request_id
        self.stamp("REQUEST_START", ns)

    def queued(self, request: InferRequest, ns: int) -> None:
        self.stamp("QUEUE_START", ns)
        if self.tensors:
            for tensor in request.inputs:
                data = tensor.data if tensor.region is None else None
                self.entries.append(tensor_entry(
                    self.id, "TENSOR_QUEUE_INPUT", tensor.name, tensor.datatype, tensor.shape,
                    data,
                ))  # fmt: skip

    def computed(self, reply: WorkerReply, outputs: Iterable[OutputTensor]) -> None:
        """The worker's timestamps of the execution, and the outputs it returned."""
        t = reply.timings
        if t is not None:
            self.stamp("COMPUTE_START", t.input_start)
            self.stamp("COMPUTE_INPUT_END", t.infer_start)
            self.stamp("COMPUTE_OUTPUT_START", t.infer_end)
            self.stamp("COMPUTE_END", t.output_end)
        self.outputs(outputs)

    def outputs(self, outputs: Iterable[OutputTensor]) -> None:
        if self.tensors:
            for out in outputs:
                data = out.data if out.lent is None else None
                self.entries.append(tensor_entry(
                    self.id, "TENSOR_BACKEND_OUTPUT", out.name, out.datatype, out.shape, data,
                ))  # fmt: skip

    def release(self) -> None:
        """This request is done; the group is written once all of it is. Once only: a
        trace the server cut short at shutdown may be released again by its caller."""
        if self._tracer.live.pop(self.id, None) is None:
            return
        group = self._group
        group.open -= 1
        if group.open == 0:
            self._tracer.done(group)

    def json(self) -> str:
        """This trace's objects in Triton's form, joined by commas: its header, one object
        per timestamp, one per tensor (formatted here: json.dumps per timestamp cost three
        times as much)."""
        head = f'{{"id":{self.id},"model_name":{_string(self.model_name)},' \
            f'"model_version":{self.model_version}'  # fmt: skip
        if self.request_id:
            head += f',"request_id":{_string(self.request_id)}'
        if self.parent_id:
            head += f',"parent_id":{self.parent_id}'
        parts = [head + "}"]
        prefix = f'{{"id":{self.id},"timestamps":[{{"name":"'
        parts.extend(f'{prefix}{name}","ns":{ns}}}]}}' for name, ns in self.stamps)
        parts.extend(_JSON.encode(entry) for entry in self.entries)
        return ",".join(parts)


class Tracer:
    """Samples requests, keeps the traces in flight, writes the done ones."""

    def __init__(self, startup: Mapping[str, Sequence[str]] | None = None) -> None:
        self.settings = TraceSettings(startup, on_retire=self._retired)
        path = self.settings.global_setting.file
        self.file: TraceFile | None = TraceFile(path) if path else None
        self.live: dict[int, Trace] = {}  # traces in flight, by id (BLS calls name them)
        self._last_id = 0

    @property
    def active(self) -> bool:
        """Some setting samples requests: the frontends ask :meth:`sample`."""
        return self.settings.active

    def next_id(self) -> int:
        self._last_id += 1
        return self._last_id

    def sample(self, model_name: str) -> Trace | None:
        """A trace for this request of ``model_name``, or None (Triton's SampleTrace)."""
        setting = self.settings.effective(model_name)
        if not setting.valid:
            return None
        setting.sample += 1
        if setting.sample % setting.rate:
            return None
        if setting.count > 0:
            setting.count -= 1
            if setting.count == 0:
                setting.check()
                self.settings.refresh()
        setting.open += 1
        return Trace(self, _Group(setting), model_name, 0)

    def done(self, group: _Group) -> None:
        setting = group.setting
        setting.pending.append(",".join(trace.json() for trace in group.traces))
        setting.collected += 1
        setting.in_stream += 1
        setting.open -= 1
        every = setting.log_frequency
        if (setting.count == 0 and setting.collected == setting.sample) or (
            every and setting.in_stream >= every
        ):
            self._write(setting, numbered=True)
        elif setting.retired and setting.open == 0:
            self._write(setting, numbered=every != 0)

    def _retired(self, setting: Setting) -> None:
        if setting.open == 0:
            self._write(setting, numbered=setting.log_frequency != 0)

    def _write(self, setting: Setting, numbered: bool) -> None:
        if not setting.pending or self.file is None:
            return
        text = ",".join(setting.pending)
        setting.pending.clear()
        setting.in_stream = 0
        self.file.save(text, numbered)

    def close(self) -> None:
        """The server stops: what every setting holds is written, the file closed."""
        for trace in list(self.live.values()):  # cut short: still written
            trace.release()
        self.settings.retire_all()
        if self.file is not None:
            self.file.close()
