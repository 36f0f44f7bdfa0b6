"""Checks a request against its model's inputs and outputs before it runs: in the server
(``server/core/request_validator.py`` reads them from the config) and in a BLS caller that calls
another model's instance directly (``worker/bls/direct_caller.py`` gets them from the server).

Messages follow Triton's so that clients matching on them keep working.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from dlserve.errors import InvalidArgumentError
from dlserve.tensors import dtypes
from dlserve.types import InferRequest, InputTensor

_LEN = struct.Struct("<I")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: dtypes.DType
    dims: tuple[int, ...]
    reshape: tuple[int, ...] | None
    optional: bool
    fixed: tuple[tuple[int, int], ...] = ()  # (index, size) of the dims that are not -1


def tensor_spec(
    name: str, dtype: dtypes.DType, dims: tuple[int, ...], reshape: tuple[int, ...] | None = None,
    optional: bool = False,
) -> TensorSpec:  # fmt: skip
    fixed = tuple((i, d) for i, d in enumerate(dims) if d != -1)
    return TensorSpec(name, dtype, dims, reshape, optional, fixed)


def _matches(spec: TensorSpec, shape: tuple[int, ...]) -> bool:
    """``shape`` (without the batch dimension) fits the config's dims (-1: any size)."""
    if len(spec.dims) != len(shape):
        return False
    for index, size in spec.fixed:
        if shape[index] != size:
            return False
    return True


def _fmt(shape: tuple[int, ...]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def count_bytes_elements(data: memoryview) -> int:
    """Elements in a BYTES tensor's wire form; raises ValueError when it is malformed."""
    view = data.cast("B") if data.format != "B" else data
    count = offset = 0
    end = view.nbytes
    while offset < end:
        if offset + 4 > end:
            raise ValueError("incomplete element length")
        (length,) = _LEN.unpack_from(view, offset)
        offset += 4 + length
        if offset > end:
            raise ValueError("element runs past the end of the data")
        count += 1
    return count


class SpecValidator:
    """Checks requests against a model's inputs and outputs (``TensorSpec``)."""

    def __init__(
        self, model: str, max_batch_size: int, inputs: list[TensorSpec], outputs: list[TensorSpec]
    ) -> None:
        self.model = model
        self.max_batch_size = max_batch_size
        self.inputs = {s.name: s for s in inputs}
        self.outputs = {s.name: s for s in outputs}
        self.required = [n for n, s in self.inputs.items() if not s.optional]
        self.reshapes_outputs = any(s.reshape is not None for s in self.outputs.values())
        self.reshapes = self.reshapes_outputs or any(
            s.reshape is not None for s in self.inputs.values()
        )

    def check(self, request: InferRequest) -> tuple[list[InputTensor], int]:
        """The inputs as the model should see them (reshaped), and the batch size.

        In Triton's order, so that a request with several faults gets Triton's error: the
        requested outputs, the number of inputs, then each input (its name, type, shape
        and size)."""
        if request.outputs:
            self._check_outputs(request)
        self._check_count(request)
        batch = 0
        checked: list[InputTensor] = []
        for tensor in request.inputs:
            spec = self.inputs.get(tensor.name)
            if spec is None:
                raise InvalidArgumentError(
                    f"{_prefix(request)}unexpected inference input '{tensor.name}' for model "
                    f"'{self.model}'"
                )
            tensor_batch = self._check_one(request, spec, tensor)
            if batch and tensor_batch != batch:
                raise InvalidArgumentError(
                    f"{_prefix(request)}inputs of model '{self.model}' must have the same "
                    "batch size"
                )
            batch = tensor_batch
            checked.append(tensor if spec.reshape is None else self._reshaped(spec, tensor))
        self._check_missing(request)
        return checked, batch or 1

    def _check_one(self, request: InferRequest, spec: TensorSpec, tensor: InputTensor) -> int:
        if tensor.datatype != spec.dtype.wire:
            raise InvalidArgumentError(
                f"{_prefix(request)}inference input '{tensor.name}' data-type is "
                f"'{tensor.datatype}', but model '{self.model}' expects '{spec.dtype.wire}'"
            )
        shape = tensor.shape
        batch = 0
        dims = shape
        if self.max_batch_size > 0:
            if not shape or shape[0] < 1 or shape[0] > self.max_batch_size:
                got = shape[0] if shape else "none"
                raise InvalidArgumentError(
                    f"{_prefix(request)}inference request batch-size must be <= "
                    f"{self.max_batch_size} for '{self.model}' (input '{tensor.name}' has "
                    f"batch size {got})"
                )
            batch, dims = shape[0], shape[1:]
        if (shape and min(shape) < 0) or not _matches(spec, dims):
            expected = ((-1,) if self.max_batch_size > 0 else ()) + spec.dims
            raise InvalidArgumentError(
                f"{_prefix(request)}unexpected shape for input '{tensor.name}' for model "
                f"'{self.model}'. Expected {_fmt(expected)}, got {_fmt(shape)}"
            )
        self._check_size(request, spec, tensor)
        return batch

    def _check_size(self, request: InferRequest, spec: TensorSpec, tensor: InputTensor) -> None:
        data = tensor.data
        elements = math.prod(tensor.shape)
        if data is None:
            # In a client's region: the worker counts BYTES elements, the server never reads.
            if tensor.region is not None and not spec.dtype.is_bytes:
                self._check_nbytes(request, spec, tensor, elements, tensor.region.byte_size)
            return
        if spec.dtype.is_bytes:
            prefix = _prefix(request)
            try:
                got = count_bytes_elements(data)
            except ValueError as exc:
                raise InvalidArgumentError(
                    f"{prefix}input '{tensor.name}' for model '{self.model}' is not valid BYTES "
                    f"data: {exc}"
                ) from None
            if got != elements:
                raise InvalidArgumentError(
                    f"{prefix}unexpected number of string elements {got} for inference input "
                    f"'{tensor.name}' for model '{self.model}', expecting {elements}"
                )
            return
        self._check_nbytes(request, spec, tensor, elements, data.nbytes)

    def _check_nbytes(
        self, request: InferRequest, spec: TensorSpec, tensor: InputTensor, elements: int,
        nbytes: int,
    ) -> None:  # fmt: skip
        expected = elements * spec.dtype.itemsize
        if nbytes != expected:
            raise InvalidArgumentError(
                f"{_prefix(request)}input byte size mismatch for input '{tensor.name}' for model "
                f"'{self.model}'. Expected {expected}, got {nbytes}"
            )

    @staticmethod
    def _reshaped(spec: TensorSpec, tensor: InputTensor) -> InputTensor:
        if spec.reshape is None:
            return tensor
        batch = tensor.shape[: len(tensor.shape) - len(spec.dims)]
        return InputTensor(
            tensor.name, tensor.datatype, batch + spec.reshape, tensor.data, tensor.parameters,
            tensor.region,
        )  # fmt: skip

    def _check_count(self, request: InferRequest) -> None:
        """Too many inputs or too few, before anything else about them (Triton's text)."""
        count = len(request.inputs)
        if len(self.required) <= count <= len(self.inputs):
            return
        if len(self.required) == len(self.inputs):
            expected = f"{len(self.inputs)} inputs"
        else:
            expected = f"number of inputs between {len(self.required)} and {len(self.inputs)}"
        raise InvalidArgumentError(
            f"{_prefix(request)}expected {expected} but got {count} inputs for model "
            f"'{self.model}'. {self._missing_text(request)}"
        )

    def _missing_text(self, request: InferRequest) -> str:
        given = {t.name for t in request.inputs}
        missing = [n for n in self.required if n not in given]
        return (
            f"Got input(s) {_names(sorted(given))}, but missing required input(s) "
            f"{_names(missing)}. Please provide all required input(s)."
        )

    def _check_missing(self, request: InferRequest) -> None:
        """A required input left out while the count is right (an optional one given)."""
        given = {t.name for t in request.inputs}
        if len(given) != len(request.inputs):
            raise InvalidArgumentError(f"{_prefix(request)}an input is given more than once")
        if len(given) == len(self.inputs):  # every input the model has (all names known)
            return
        if any(n not in given for n in self.required):
            raise InvalidArgumentError(
                f"{_prefix(request)}expected {len(self.required)} inputs but got {len(given)} "
                f"inputs for model '{self.model}'. {self._missing_text(request)}"
            )

    def _check_outputs(self, request: InferRequest) -> None:
        if not self.outputs:
            return
        for output in request.outputs:
            if output.name not in self.outputs:
                raise InvalidArgumentError(
                    f"{_prefix(request)}unexpected inference output '{output.name}' for model "
                    f"'{self.model}'"
                )

    def output_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """An output's shape as the client sees it (the config's dims where it reshapes)."""
        spec = self.outputs.get(name)
        if spec is None or spec.reshape is None:
            return shape
        batch = shape[: len(shape) - len(spec.reshape)]
        return batch + spec.dims


def _names(names: list[str]) -> str:
    """A list of names as Triton writes it: ['A','B']."""
    return "[" + ",".join(f"'{name}'" for name in names) + "]"


def _prefix(request: InferRequest) -> str:
    """The start of an error message about ``request``, as Triton's."""
    return f"[request id: {request.id or '<id_unknown>'}] "
