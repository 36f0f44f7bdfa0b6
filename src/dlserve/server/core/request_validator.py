"""Checks a request against its model's config before it is sent to an instance: the
config's inputs and outputs read into a :class:`~dlserve.tensors.validation.SpecValidator`.
"""

from __future__ import annotations

from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from dlserve.tensors import dtypes
from dlserve.tensors.validation import SpecValidator, TensorSpec, tensor_spec

__all__ = ["RequestValidator", "TensorSpec"]


def _spec(entry: Any) -> TensorSpec:
    dtype = dtypes.from_config(mc.DataType.Name(entry.data_type))
    assert dtype is not None  # checked when the config was normalized
    reshape = tuple(entry.reshape.shape) if entry.HasField("reshape") else None
    optional = bool(getattr(entry, "optional", False))
    return tensor_spec(entry.name, dtype, tuple(entry.dims), reshape, optional)


class RequestValidator(SpecValidator):
    """The validator of a model's config (a ``ModelConfig`` message)."""

    def __init__(self, config: Any) -> None:
        super().__init__(
            config.name,
            int(config.max_batch_size),
            [_spec(e) for e in config.input],
            [_spec(e) for e in config.output],
        )
