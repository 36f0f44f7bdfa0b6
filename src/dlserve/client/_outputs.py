"""Outputs the server can write straight into the client's regions: those whose size the
model's configuration fixes (every dim known, no batching, no reshape, not BYTES).

Their room is reserved in the call's region beside its inputs; the worker writes them
there (for a GPU: a device-to-device copy), and the SDK copies them out before it gives the
region back. Any other output comes back in the response.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from dlserve.client import _cuda
from dlserve.client._pool import Slot
from dlserve.client._tensors import DeviceArray
from dlserve.tensors import dtypes
from dlserve.tensors.dtypes import DType


@dataclass(frozen=True, slots=True)
class OutputLayout:
    name: str
    dtype: DType
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass(slots=True)
class PlacedOutput:
    layout: OutputLayout
    device: int  # -1: host
    slot: Slot | None = None
    offset: int = 0


@dataclass(frozen=True, slots=True)
class ModelOutputs:
    """A model's outputs as its configuration declares them: every name, and the layouts
    of those whose size is fixed."""

    names: tuple[str, ...]
    fixed: dict[str, OutputLayout]
    largest: int = 0  # bytes of the largest fixed-size output


UNKNOWN = ModelOutputs((), {})


def fixed_outputs(config: Mapping[str, Any]) -> dict[str, OutputLayout]:
    """The outputs of a model configuration (JSON form) whose size is fixed."""
    return model_outputs(config).fixed


def model_outputs(config: Mapping[str, Any]) -> ModelOutputs:
    """Every output of a model configuration (JSON form), and those of fixed size."""
    batched = int(config.get("max_batch_size", 0) or 0) > 0
    names: list[str] = []
    found: dict[str, OutputLayout] = {}
    for output in config.get("output", []):
        name = str(output["name"])
        names.append(name)
        dtype = dtypes.from_config(str(output.get("data_type", "")))
        dims = tuple(int(d) for d in output.get("dims", []))
        if batched or dtype is None or dtype.is_bytes or "reshape" in output:
            continue
        if any(d < 0 for d in dims):
            continue
        found[name] = OutputLayout(name, dtype, dims)
    largest = max((layout.nbytes for layout in found.values()), default=0)
    return ModelOutputs(tuple(names), found, largest)


class LayoutCache:
    """Models' outputs per (model, version), asked of the server once."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, str], ModelOutputs] = {}
        self._lock = threading.Lock()

    def get(self, model: str, version: str) -> ModelOutputs | None:
        with self._lock:
            return self._known.get((model, version))

    def forget(self, model: str, version: str) -> None:
        with self._lock:
            self._known.pop((model, version), None)

    def put(self, model: str, version: str, config: Any, protocol: str) -> ModelOutputs:
        body = config.get("config", {}) if protocol == "grpc" else config
        layouts = model_outputs(body)
        with self._lock:
            self._known[(model, version)] = layouts
        return layouts


def read_placed(result: Any, protocol: str, placed: PlacedOutput) -> Any:
    """A placed output, copied out of the call's region (the region goes back to the pool)."""
    layout, slot = placed.layout, placed.slot
    assert slot is not None
    shape = _response_shape(result, protocol, layout.name) or layout.shape
    nbytes = int(np.prod(shape, dtype=np.int64)) * layout.dtype.itemsize
    if nbytes > layout.nbytes:
        raise ValueError(f"output '{layout.name}' of shape {shape} overflows its reserved room")
    if placed.device < 0:
        storage = layout.dtype.numpy_storage
        count = nbytes // storage.itemsize
        view: npt.NDArray[Any] = np.frombuffer(
            slot.region.buf, dtype=storage, count=count, offset=placed.offset
        )
        return view.reshape(shape).copy()
    ptr = _cuda.malloc(placed.device, max(nbytes, 1))
    tensor = DeviceArray(ptr, tuple(shape), layout.dtype, placed.device)
    _cuda.copy(ptr, slot.region.device_ptr + placed.offset, nbytes, placed.device)
    return tensor


def _response_shape(result: Any, protocol: str, name: str) -> tuple[int, ...] | None:
    output = result.get_output(name)
    if output is None:
        return None
    shape = output.shape if protocol == "grpc" else output.get("shape", [])
    return tuple(int(d) for d in shape)
