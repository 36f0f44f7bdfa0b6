"""A tensor as Triton's TENSORS trace level writes it: its elements as text, joined by
commas (BOOL as 1/0, floats as C++ streams print them, ``%g``; BYTES elements each in
double quotes; FP16 and BF16 left empty, as Triton leaves them), its shape as "1,16".

A tensor the server does not hold (in a client's system or CUDA shared-memory region,
or lent between workers) is written without ``data``: the server does not map that
memory, and reading it for a trace would be the per-request cost tracing must not add
(docs/differences.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from dlserve.tensors import dtypes

_EMPTY: Final = frozenset({"FP16", "BF16"})


def tensor_entry(
    trace_id: int, activity: str, name: str, datatype: str, shape: Sequence[int],
    data: bytes | memoryview | None,
) -> dict[str, Any]:  # fmt: skip
    tensor: dict[str, Any] = {"name": name}
    if data is not None:
        text = tensor_text(datatype, data)
        if text is not None:
            tensor["data"] = text
    tensor["shape"] = ",".join(str(d) for d in shape)
    tensor["dtype"] = datatype
    return {"id": trace_id, "activity": activity, "tensor": tensor}


def tensor_text(datatype: str, data: bytes | memoryview) -> str | None:
    """The elements as Triton writes them; None when the bytes do not hold them."""
    if datatype in _EMPTY:
        return ""
    if datatype == "BYTES":
        try:
            items = dtypes.deserialize_bytes(memoryview(data).cast("B"))
        except ValueError:
            return None
        return ",".join(f'"{_text(item)}"' for item in items.tolist())
    dtype = dtypes.from_wire(datatype)
    if dtype is None or dtype.numpy is None:
        return None
    raw = memoryview(data).cast("B")
    if len(raw) % dtype.itemsize:
        return None
    values = np.frombuffer(raw, dtype=dtype.numpy).tolist()
    if datatype == "BOOL":
        return ",".join("1" if v else "0" for v in values)
    if datatype in ("FP32", "FP64"):
        return ",".join("%g" % v for v in values)  # noqa: UP031 (C++ ostream's format)
    return ",".join(str(v) for v in values)


def _text(item: object) -> str:
    if isinstance(item, bytes):
        return item.decode("utf-8", "backslashreplace")
    return str(item)
