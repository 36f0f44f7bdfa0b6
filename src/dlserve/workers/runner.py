"""Runs one model instance inside a worker: load, execute, finalize.

Inputs become numpy views of the bytes the server delivered (the frame's
payload, or the input arena) or of a client's shared-memory region; outputs go
back inline when small, through this worker's output arena, or straight into
the client region the request names for them.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import inspect
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from dlserve import backend as pb_utils
from dlserve.backend.errors import TritonError
from dlserve.ipc import messages as m
from dlserve.tensors import dtypes
from dlserve.tensors.shm import Arena, ShmSegment
from dlserve.workers import gpu_io
from dlserve.workers.outputs import OutputWriter
from dlserve.workers.regions import ClientRegions


class LoadError(Exception):
    """model.py could not be imported, auto-completed or initialized."""


def describe_exception(exc: BaseException, model_dir: str) -> str:
    """The error's message with the file and line in the model's code where it arose."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{type(exc).__name__}: {exc.msg} ({exc.filename}, line {exc.lineno})"
    location = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename.startswith(model_dir):
            location = f" ({frame.filename}, line {frame.lineno})"
    return f"{type(exc).__name__}: {exc}{location}"


def import_model_file(path: str, module_name: str) -> ModuleType:
    directory = os.path.dirname(path)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise LoadError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


class ModelRunner:
    """One instance of one model."""

    def __init__(self, load: m.Load, arenas: tuple[ShmSegment, ShmSegment]) -> None:
        """``arenas``: the input arena (the server writes) and the output arena (we write)."""
        self.load = load
        self.config: dict[str, Any] = json.loads(load.config_json)
        self.model: Any = None
        self.model_class: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.input_arena, self.output_segment = arenas
        self.output_arena = Arena(self.output_segment)
        self.regions = ClientRegions()
        self.gpu = gpu_io.GpuIO(gpu_io.Placement.AS_ARRIVED, 0, self.regions, self.output_arena)
        self.device_uuid = ""
        self.outputs = OutputWriter(self.regions, self.output_arena, self.gpu)

    # -- loading ------------------------------------------------------------------------
    def update(self, load: m.Load) -> None:
        """A second Load on the same worker: the final config and this instance's identity."""
        self.load = load
        self.config = json.loads(load.config_json)

    def start(self) -> None:
        """Import, auto-complete and initialize; raises LoadError with the reason."""
        load = self.load
        try:
            if self.model_class is None:
                module = import_model_file(load.model_file, f"dlserve_model_{os.getpid()}")
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
            raise LoadError(describe_exception(exc, load.model_path)) from exc

    def _bind_device(self) -> None:
        """Input placement from the config; a GPU instance's device made current."""
        load = self.load
        try:
            placement = gpu_io.placement_of(self.config, load.instance_kind)
        except ValueError as exc:
            raise LoadError(str(exc)) from None
        self.gpu = gpu_io.GpuIO(placement, load.device_id, self.regions, self.output_arena)
        self.outputs.gpu = self.gpu
        pb_utils.gpu.model_name = load.model_name
        if load.instance_kind == "GPU":
            try:
                self.device_uuid = gpu_io.bind_device(load.device_id)
            except ValueError as exc:
                raise LoadError(str(exc)) from None

    def _auto_complete(self, model_class: Any) -> dict[str, Any]:
        from dlserve.backend.config import ModelConfig

        completed = model_class.auto_complete_config(ModelConfig(self.config))
        if not isinstance(completed, ModelConfig):
            raise LoadError(
                "auto_complete_config must return the pb_utils.ModelConfig it was given"
            )
        return completed.as_dict()

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
        result = function(*args)
        if inspect.isawaitable(result):
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            result = self._loop.run_until_complete(result)
        return result

    # -- inference ----------------------------------------------------------------------
    def infer(self, msg: m.Infer, payload: memoryview) -> tuple[m.InferDone, list[memoryview]]:
        timings_start = time.monotonic_ns()
        if msg.release:
            self.release(msg.release)
        try:
            request = self._request(msg, payload)
            infer_start = time.monotonic_ns()
            responses = self._call(self.model.execute, [request])
            infer_end = time.monotonic_ns()
            response = self._single_response(responses)
            done, buffers = self._reply(msg, response)
        except BaseException as exc:  # the model's failure is the request's failure
            return self._error_reply(msg.rid, exc), []
        finally:
            self.outputs.drop_buffers()
        done.timings = m.Timings(timings_start, infer_start, infer_end, time.monotonic_ns())
        return done, buffers

    def _request(self, msg: m.Infer, payload: memoryview) -> pb_utils.InferenceRequest:
        inputs = [self._input_tensor(ref, payload) for ref in msg.inputs]
        request = pb_utils.InferenceRequest(
            model_name=self.load.model_name,
            inputs=inputs,
            requested_output_names=msg.outputs,
            request_id=msg.request_id,
            parameters=msg.parameters,
        )
        targets = {t.name: t for t in msg.output_regions}
        outputs = self.outputs
        request._output_buffer = functools.partial(outputs.buffer, targets)  # type: ignore[attr-defined]
        return request

    def _input_tensor(self, ref: m.TensorRef, payload: memoryview) -> pb_utils.Tensor:
        if ref.where == m.Where.CUDA_REGION:
            return self.gpu.region_input(ref)
        tensor = pb_utils.Tensor._wrap(ref.name, *self._input_array(ref, payload))
        return self.gpu.place(tensor)

    def _input_array(
        self, ref: m.TensorRef, payload: memoryview
    ) -> tuple[npt.NDArray[Any], dtypes.DType]:
        dtype = dtypes.BY_WIRE[ref.datatype]
        if ref.where == m.Where.PAYLOAD:
            raw = payload[ref.offset : ref.offset + ref.nbytes]
        elif ref.where == m.Where.CLIENT_REGION:  # writable: the model may write into it
            raw = self.regions.view(ref, f"input '{ref.name}'")
            if dtype.is_bytes:
                return _region_bytes(ref, raw), dtype
        else:
            raw = self.input_arena.buffer[ref.offset : ref.offset + ref.nbytes]
        if dtype.is_bytes:
            return dtypes.deserialize_bytes(raw).reshape(ref.shape), dtype
        return np.frombuffer(raw, dtype=dtype.numpy_storage).reshape(ref.shape), dtype

    def _single_response(self, responses: Any) -> pb_utils.InferenceResponse:
        if not isinstance(responses, list | tuple) or len(responses) != 1:
            got = (
                len(responses) if isinstance(responses, list | tuple) else type(responses).__name__
            )
            raise TritonError(f"execute() must return a list of 1 InferenceResponse, got {got}")
        response = responses[0]
        if not isinstance(response, pb_utils.InferenceResponse):
            raise TritonError(
                f"execute() returned {type(response).__name__}, not pb_utils.InferenceResponse"
            )
        error = response.error()
        if error is not None:
            raise error
        return response

    def _reply(
        self, msg: m.Infer, response: pb_utils.InferenceResponse
    ) -> tuple[m.InferDone, list[memoryview]]:
        wanted = set(msg.outputs)
        targets = {t.name: t for t in msg.output_regions}
        refs: list[m.TensorRef] = []
        buffers: list[memoryview] = []
        offset = 0
        for tensor in response.output_tensors():
            if wanted and tensor.name() not in wanted:
                continue
            target = targets.get(tensor.name()) if targets else None
            ref, buffer = self.outputs.ref(tensor, offset, target)
            refs.append(ref)
            if buffer is not None:
                buffers.append(buffer)
                offset += buffer.nbytes
        text = response.parameters()
        params = json.loads(text) if text != "{}" else {}
        return m.InferDone(rid=msg.rid, outputs=refs, parameters=params), buffers

    def unmap_regions(self, regions: list[int]) -> None:
        self.regions.unmap(regions)

    def _error_reply(self, rid: int, exc: BaseException) -> m.InferDone:
        if isinstance(exc, TritonError):
            return m.InferDone(rid=rid, error=exc.message(), error_code=exc.error_code().value)
        message = describe_exception(exc, self.load.model_path)
        return m.InferDone(rid=rid, error=message, error_code="internal")

    def release(self, offsets: Sequence[int]) -> None:
        for offset in offsets:
            self.output_arena.free(offset)

    # -- shutdown -----------------------------------------------------------------------
    def finalize(self) -> None:
        if self.model is not None and hasattr(self.model, "finalize"):
            try:
                self._call(self.model.finalize)
            except Exception:
                traceback.print_exc()
        self.regions.close()
        self.output_segment.close()
        self.input_arena.close()


def _region_bytes(ref: m.TensorRef, raw: memoryview) -> npt.NDArray[Any]:
    """A BYTES input from a client region, checked here: the server never reads it."""
    try:
        items = dtypes.deserialize_bytes(raw)
    except ValueError as exc:
        raise TritonError(
            f"input '{ref.name}' in shared memory is not valid BYTES data: {exc}",
            TritonError.INVALID_ARG,
        ) from None
    expected = math.prod(ref.shape)
    if items.size != expected:
        raise TritonError(
            f"unexpected number of string elements {items.size} for inference input "
            f"'{ref.name}', expecting {expected}",
            TritonError.INVALID_ARG,
        )
    return items.reshape(ref.shape)
