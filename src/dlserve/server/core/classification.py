"""Triton's classification extension: an output requested with a ``classification``
parameter (tritonclient's ``class_count``) comes back as its top-k entries instead of its
values.

Each entry is a BYTES element ``"<value>:<index>"``, or ``"<value>:<index>:<label>"`` when
the output's ``label_filename`` (a file in the model's folder, one label per line) has a
label for that index. Values are written as Triton writes them (C++ ``std::to_string``:
floats with six decimals). For a model that batches, each batch entry gets its own top k
and the output's shape is ``[batch, k]``; otherwise ``[k]`` (k at most the number of
values). Ties keep index order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from dlserve import errors
from dlserve.server.core.models.config import ConfigError
from dlserve.tensors import dtypes
from dlserve.types import InferRequest, OutputTensor

CLASSIFICATION: Final = "classification"
_SUPPORTED: Final = frozenset(
    ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32", "FP64")
)

Labels = Mapping[str, Sequence[str]]  # output name -> its labels, by class index


def load_labels(config: Any, model_dir: Path) -> dict[str, list[str]]:
    """The labels of every output that names a ``label_filename``; ConfigError if unreadable."""
    labels: dict[str, list[str]] = {}
    for output in config.output:
        if not output.label_filename:
            continue
        path = model_dir / output.label_filename
        try:
            labels[output.name] = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"unable to read the label file '{output.label_filename}' of output "
                f"'{output.name}': {exc}"
            ) from None
    return labels


def requested(request: InferRequest) -> dict[str, int]:
    """The outputs asked for as classifications, and how many classes each; checked before
    the request runs."""
    classes: dict[str, int] = {}
    for output in request.outputs:
        count = output.parameters.get(CLASSIFICATION)
        if count is None:
            continue
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise errors.InvalidArgumentError(
                f"the 'classification' parameter of output '{output.name}' must be a "
                f"non-negative integer, not {count!r}"
            )
        if count == 0:
            continue  # Triton: 0 asks for the output itself
        if output.region is not None:
            raise errors.InvalidArgumentError(
                "Output can't set both 'shared_memory_region' and 'classification'"
            )
        classes[output.name] = count
    return classes


def apply(
    outputs: list[OutputTensor], classes: Mapping[str, int], batched: bool, labels: Labels
) -> list[OutputTensor]:
    """``outputs`` with the asked-for ones replaced by their classifications."""
    return [
        _classified(o, classes[o.name], batched, labels.get(o.name, ()))
        if o.name in classes else o
        for o in outputs
    ]  # fmt: skip


def _classified(output: OutputTensor, k: int, batched: bool, labels: Sequence[str]) -> OutputTensor:
    if output.datatype not in _SUPPORTED or output.data is None:
        raise errors.InvalidArgumentError(
            f"class result not available for output due to unsupported type '{output.datatype}'"
        )
    storage = dtypes.BY_WIRE[output.datatype].numpy_storage
    values = np.frombuffer(output.data, dtype=storage)
    batch = output.shape[0] if batched and output.shape else 0
    rows = values.reshape(max(batch, 1), -1) if values.size else values.reshape(max(batch, 1), 0)
    count = min(k, rows.shape[1])
    entries: list[bytes] = []
    for row in rows:
        for index in _top(row, count):
            entries.append(_entry(row[index], int(index), labels))
    shape = (batch, count) if batch else (count,)
    return OutputTensor(output.name, "BYTES", shape, _serialize(entries), output.parameters)


def _top(row: np.ndarray[Any, Any], count: int) -> np.ndarray[Any, Any]:
    """The indices of the ``count`` largest values, largest first, ties in index order."""
    last = row.size - 1
    ascending_from_the_end = np.argsort(row[::-1], kind="stable")
    return last - ascending_from_the_end[::-1][:count]


def _entry(value: Any, index: int, labels: Sequence[str]) -> bytes:
    text = f"{float(value):f}" if isinstance(value, np.floating) else str(int(value))
    text = f"{text}:{index}"
    if index < len(labels) and labels[index]:
        text = f"{text}:{labels[index]}"
    return text.encode()


def _serialize(entries: list[bytes]) -> bytes:
    parts = []
    for entry in entries:
        parts.append(len(entry).to_bytes(4, "little"))
        parts.append(entry)
    return b"".join(parts)
