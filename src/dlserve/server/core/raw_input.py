"""A raw binary request (HTTP ``Inference-Header-Content-Length: 0``): the whole body is the
data of the model's one input, whose name, data type and shape come from its config, as
Triton deduces them.

- The model must have exactly one input.
- The shape is the input's dims, after a batch dimension of 1 when the model batches; at
  most one dim may be -1, and it is what the body's size makes it.
- A BYTES input must have a shape of one element: the body is that element.

What the shape cannot say (a body whose size does not fit it) is found by validation,
as for any request.
"""

from __future__ import annotations

import math
import struct
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from dlserve import errors
from dlserve.tensors import dtypes
from dlserve.types import InputTensor

_LENGTH = struct.Struct("<I")  # a BYTES element's length prefix


def raw_input(model: str, config: Any, body: memoryview) -> InputTensor:
    """The one input a raw request of ``model`` (its ModelConfig ``config``) carries."""
    if len(config.input) != 1:
        raise errors.InvalidArgumentError(
            "Raw request must only have 1 input (found 1) to be deduced but got "
            f"{len(config.input)} inputs in '{model}' model configuration"
        )
    spec = config.input[0]
    dtype = dtypes.from_config(mc.DataType.Name(spec.data_type))
    if dtype is None:
        raise errors.InvalidArgumentError(f"input '{spec.name}' has no data type")
    shape = ([1] if config.max_batch_size > 0 else []) + list(spec.dims)
    variable = [axis for axis, dim in enumerate(shape) if dim == -1]
    if len(variable) > 1:
        raise errors.InvalidArgumentError(
            f"The shape of the raw input '{spec.name}' can not be deduced because there are "
            "more than one variable-sized dimension"
        )
    if dtype.is_bytes:
        if variable or math.prod(shape) != 1:
            raise errors.InvalidArgumentError(
                f"For BYTE datatype raw input '{spec.name}', the model must have input shape [1]"
            )
        data = memoryview(_LENGTH.pack(len(body)) + body)  # one element: the whole body
        return InputTensor(spec.name, dtype.wire, tuple(shape), data)
    if variable:
        known = math.prod(dim for dim in shape if dim != -1) * dtype.itemsize
        shape[variable[0]] = len(body) // known if known else 0
    return InputTensor(spec.name, dtype.wire, tuple(shape), body)
