"""``pb_utils.MetricFamily`` and ``pb_utils.Metric``: a model's own Prometheus metrics.

The values live in the server (server/core/telemetry/metrics.py), which shows them on its metrics
endpoint. Updates go as one-way frames (MetricFamilyDef, MetricOp); ``value()``
is a call that waits for the server's MetricValueReply. Frames on one channel
keep their order, so ``value()`` sees every earlier update of this worker.

Triton's rules are checked here, with Triton's messages: counters only go up,
gauges are set or moved, histograms only observe and need their buckets.

Deliberate difference: Triton deletes a metric when its Python object is
garbage-collected; dlserve keeps it (and its value) until the server exits.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import ClassVar, Final

from dlserve.ipc import messages as m
from dlserve.pb_utils import arguments
from dlserve.pb_utils.exceptions import TritonModelException
from dlserve.pb_utils.runtime import current as _runtime

_METRIC_NAME: Final = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_NAME: Final = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_FAMILY_SIGNATURE: Final = (
    f"{arguments.MODULE}.MetricFamily(name: str, description: str, kind: "
    f"{arguments.MODULE}.MetricKind)"
)


class MetricKind(enum.IntEnum):
    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2


_KIND_NAMES: Final = {
    MetricKind.COUNTER: "counter",
    MetricKind.GAUGE: "gauge",
    MetricKind.HISTOGRAM: "histogram",
}
_TRITON_KIND: Final = {
    MetricKind.COUNTER: "TRITONSERVER_METRIC_KIND_COUNTER",
    MetricKind.GAUGE: "TRITONSERVER_METRIC_KIND_GAUGE",
    MetricKind.HISTOGRAM: "TRITONSERVER_METRIC_KIND_HISTOGRAM",
}


def _labels(labels: object) -> dict[str, str]:
    """The labels as Triton takes them: a dict that ``json.dumps`` writes (its TypeError
    for values JSON has no form of, bytes among them), of label names and string values."""
    if labels is None:
        return {}
    if not isinstance(labels, Mapping):
        raise TritonModelException("Failed to create metric. Labels must be a dictionary.")
    json.dumps(labels)
    result: dict[str, str] = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not _LABEL_NAME.match(key) or key.startswith("__"):
            raise TritonModelException(f"Failed to create metric. Invalid label name {key!r}.")
        if not isinstance(value, str) or not _utf8(value):
            raise TritonModelException(
                f"Failed to create metric. The value of label '{key}' must be a string, "
                f"not {type(value).__name__}."
            )
        result[key] = value
    return result


def _utf8(value: str) -> bool:
    try:
        arguments.text(value, "a label value")
    except arguments.NotText:
        return False
    return True


def _buckets(kind: MetricKind, buckets: object) -> list[float]:
    if buckets is None:
        if kind == MetricKind.HISTOGRAM:
            raise TritonModelException("Failed to create metric. Missing required buckets.")
        return []
    if not isinstance(buckets, list):
        raise TritonModelException("Failed to create metric. Buckets must be a list.")
    if kind != MetricKind.HISTOGRAM:
        raise TritonModelException("Failed to create metric. Unexpected buckets found.")
    try:
        bounds = [float(b) for b in buckets]
    except (TypeError, ValueError):
        raise TritonModelException("Failed to create metric. Buckets must be numbers.") from None
    if any(a >= b for a, b in itertools.pairwise(bounds)) or any(map(math.isnan, bounds)):
        raise TritonModelException(
            "Failed to create metric. Bucket boundaries must be in strictly increasing order."
        )
    return bounds


class MetricFamily:
    """A named metric of one kind; its Metrics are its label combinations."""

    COUNTER: ClassVar[MetricKind] = MetricKind.COUNTER
    GAUGE: ClassVar[MetricKind] = MetricKind.GAUGE
    HISTOGRAM: ClassVar[MetricKind] = MetricKind.HISTOGRAM

    def __init__(self, name: str | bytes, description: str | bytes, kind: MetricKind) -> None:
        """Triton's arguments: the name and description may be bytes (UTF-8)."""
        try:
            name = arguments.text(name, "the metric family's name")
            description = arguments.text(description, "the metric family's description")
        except arguments.NotText:
            raise arguments.incompatible(
                "__init__", _FAMILY_SIGNATURE, {"name": name, "description": description,
                                                 "kind": kind}
            ) from None  # fmt: skip
        if not _METRIC_NAME.match(name):
            raise TritonModelException(f"Error when creating MetricFamily: invalid name {name!r}")
        try:
            self._kind = MetricKind(kind)
        except ValueError:
            raise TritonModelException(
                "Error when creating MetricFamily: kind must be MetricFamily.COUNTER, GAUGE "
                "or HISTOGRAM"
            ) from None
        self._name = name
        self._description = description
        _runtime().send_metric(
            "Error when creating MetricFamily",
            m.MetricFamilyDef(name, description, _KIND_NAMES[self._kind]),
        )

    @property
    def name(self) -> str:
        return self._name

    @property
    def kind(self) -> MetricKind:
        return self._kind

    def Metric(
        self, labels: Mapping[str, str] | None = None, buckets: Sequence[float] | None = None
    ) -> Metric:
        return Metric(self, _labels(labels), _buckets(self._kind, buckets))


class Metric:
    """One time series of a family (one set of label values)."""

    def __init__(self, family: MetricFamily, labels: dict[str, str], buckets: list[float]) -> None:
        self._family = family
        self._labels = labels
        self._send("Error when creating Metric", "create", 0.0, buckets)

    def _send(self, what: str, op: str, value: float, buckets: Sequence[float] = ()) -> None:
        message = m.MetricOp(self._family.name, self._labels, op, value, list(buckets))
        _runtime().send_metric(what, message)

    def _refuse(self, what: str, operation: str, *kinds: MetricKind) -> None:
        kind = self._family.kind
        if kind in kinds:
            raise TritonModelException(f"{what}: {_TRITON_KIND[kind]} does not support {operation}")

    def increment(self, value: float) -> None:
        what = "Failed to increment metric value"
        self._refuse(what, "Increment", MetricKind.HISTOGRAM)
        value = float(value)
        if self._family.kind == MetricKind.COUNTER and not value >= 0:
            raise TritonModelException(
                f"{what}: TRITONSERVER_METRIC_KIND_COUNTER can only be incremented "
                "monotonically by non-negative values."
            )
        self._send(what, "inc", value)

    def set(self, value: float) -> None:
        what = "Failed to set metric value"
        self._refuse(what, "Set", MetricKind.COUNTER, MetricKind.HISTOGRAM)
        self._send(what, "set", float(value))

    def observe(self, value: float) -> None:
        what = "Failed to observe metric value"
        self._refuse(what, "Observe", MetricKind.COUNTER, MetricKind.GAUGE)
        self._send(what, "observe", float(value))

    def value(self) -> float:
        what = "Failed to get metric value"
        self._refuse(what, "Value", MetricKind.HISTOGRAM)
        return _runtime().metric_value(what, self._family.name, self._labels)
