"""Prometheus metrics: Triton's nv_* counters and the models' own metric families.

Both are read at scrape time from plain counters (``ModelStats``) and from the
values the workers report (``CustomMetrics``), so the request path takes no lock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from dlserve.ipc import messages as m
from dlserve.server.core.telemetry.stats import ModelStats

LabelKey = tuple[tuple[str, str], ...]

_TRITON_COUNTERS: tuple[tuple[str, str, Callable[[ModelStats], float]], ...] = (
    (
        "nv_inference_request_success",
        "Number of successful inference requests, all batch sizes",
        lambda s: s.success.count,
    ),
    (
        "nv_inference_count",
        "Number of inferences performed (does not include cached requests)",
        lambda s: s.inference_count,
    ),
    (
        "nv_inference_exec_count",
        "Number of model executions performed",
        lambda s: s.execution_count,
    ),
    (
        "nv_inference_request_duration_us",
        "Cumulative inference request duration in microseconds",
        lambda s: (s.success.ns + s.fail.ns) // 1000,
    ),
    (
        "nv_inference_queue_duration_us",
        "Cumulative inference queuing duration in microseconds",
        lambda s: s.queue.ns // 1000,
    ),
    (
        "nv_inference_compute_input_duration_us",
        "Cumulative compute input duration in microseconds",
        lambda s: s.compute_input.ns // 1000,
    ),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds",
        lambda s: s.compute_infer.ns // 1000,
    ),
    (
        "nv_inference_compute_output_duration_us",
        "Cumulative inference compute output duration in microseconds",
        lambda s: s.compute_output.ns // 1000,
    ),
    (
        "dlserve_cross_device_requests_total",
        "Requests whose CUDA input was on a GPU where the model has no instance",
        lambda s: s.cross_device,
    ),
)
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
# Triton's per-model response-cache counters: only for models that use the cache.
_CACHE_COUNTERS: tuple[tuple[str, str, Callable[[ModelStats], float]], ...] = (
    ("nv_cache_num_hits_per_model", "Number of cache hits per model",
     lambda s: s.cache_hit.count),
    ("nv_cache_hit_duration_per_model", "Total cache hit duration per model, in microseconds",
     lambda s: s.cache_hit.ns // 1000),
    ("nv_cache_num_misses_per_model", "Number of cache misses per model",
     lambda s: s.cache_miss.count),
    ("nv_cache_miss_duration_per_model",
     "Total cache miss (insert+lookup) duration per model, in microseconds",
     lambda s: s.cache_miss.ns // 1000),
)  # fmt: skip


class TritonCollector(Collector):
    def __init__(self, stats: Callable[[], Iterable[ModelStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        all_stats = list(self._stats())
        yield from _counters(_TRITON_COUNTERS, all_stats)
        failure = Metric(
            "nv_inference_request_failure",
            "Number of failed inference requests, all batch sizes",
            "counter",
        )
        for s in all_stats:
            for reason in FAILURE_REASONS:
                labels = {"model": s.name, "reason": reason, "version": s.version}
                failure.add_sample(failure.name, labels, s.failures_by_reason.get(reason, 0))
        yield failure
        pending = Metric(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution per-model.",
            "gauge",
        )
        for s in all_stats:
            pending.add_sample(pending.name, {"model": s.name, "version": s.version}, s.pending)
        yield pending
        cached = [s for s in all_stats if s.cache_enabled]
        if cached:
            yield from _counters(_CACHE_COUNTERS, cached)


def _counters(
    families: tuple[tuple[str, str, Callable[[ModelStats], float]], ...],
    all_stats: list[ModelStats],
) -> Iterator[Metric]:
    for name, doc, value in families:
        metric = Metric(name, doc, "counter")
        for s in all_stats:
            metric.add_sample(name, {"model": s.name, "version": s.version}, value(s))
        yield metric


@dataclass(slots=True)
class _Histogram:
    buckets: list[float]
    counts: list[int]
    total: float = 0.0
    count: int = 0


@dataclass(slots=True)
class _Family:
    description: str
    kind: str
    values: dict[LabelKey, float] = field(default_factory=dict)
    histograms: dict[LabelKey, _Histogram] = field(default_factory=dict)


class CustomMetrics(Collector):
    """Metric families that models define with pb_utils.MetricFamily, fed by the workers."""

    def __init__(self) -> None:
        self.families: dict[str, _Family] = {}

    def handle(self, msg: m.MetricFamilyDef | m.MetricOp | m.MetricValueCall) -> m._Msg | None:
        if isinstance(msg, m.MetricFamilyDef):
            self.families.setdefault(msg.name, _Family(msg.description, msg.kind))
            return None
        family = self.families.get(msg.family)
        key: LabelKey = tuple(sorted(msg.labels.items()))
        if isinstance(msg, m.MetricValueCall):
            value = family.values.get(key, 0.0) if family is not None else 0.0
            return m.MetricValueReply(call=msg.call, value=value)
        if family is not None:
            self._apply(family, key, msg)
        return None

    def _apply(self, family: _Family, key: LabelKey, msg: m.MetricOp) -> None:
        if msg.op == "create":
            if family.kind == "histogram":
                buckets = sorted(msg.buckets) if msg.buckets else []
                family.histograms.setdefault(key, _Histogram(buckets, [0] * len(buckets)))
            else:
                family.values.setdefault(key, 0.0)
        elif msg.op == "delete":
            family.values.pop(key, None)
            family.histograms.pop(key, None)
        elif msg.op == "inc":
            family.values[key] = family.values.get(key, 0.0) + msg.value
        elif msg.op == "set":
            family.values[key] = msg.value
        elif msg.op == "observe":
            self._observe(family, key, msg.value)

    @staticmethod
    def _observe(family: _Family, key: LabelKey, value: float) -> None:
        histogram = family.histograms.get(key)
        if histogram is None:
            return
        histogram.total += value
        histogram.count += 1
        for index, bound in enumerate(histogram.buckets):
            if value <= bound:
                histogram.counts[index] += 1

    def collect(self) -> Iterator[Metric]:
        for name, family in self.families.items():
            metric = Metric(name, family.description, family.kind)
            for key, value in family.values.items():
                metric.add_sample(name, dict(key), value)
            for key, hist in family.histograms.items():
                self._histogram_samples(metric, name, dict(key), hist)
            yield metric

    @staticmethod
    def _histogram_samples(
        metric: Metric, name: str, labels: dict[str, str], h: _Histogram
    ) -> None:
        for bound, count in zip(h.buckets, h.counts, strict=True):
            metric.add_sample(f"{name}_bucket", {**labels, "le": _le(bound)}, count)
        metric.add_sample(f"{name}_bucket", {**labels, "le": "+Inf"}, h.count)
        metric.add_sample(f"{name}_count", labels, h.count)
        metric.add_sample(f"{name}_sum", labels, h.total)


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """The server's metrics, rendered in Prometheus' text format with Triton's names.

    prometheus_client's renderer names counter families ``<name>_total`` in HELP
    and TYPE lines; Triton does not, so the text is written here.
    """

    def __init__(
        self, stats: Callable[[], Iterable[ModelStats]], extra: Iterable[Collector] = ()
    ) -> None:
        self.custom = CustomMetrics()
        self._collectors: tuple[Collector, ...] = (TritonCollector(stats), self.custom, *extra)

    def render(self) -> bytes:
        lines: list[str] = []
        for collector in self._collectors:
            for metric in collector.collect():
                lines.append(f"# HELP {metric.name} {_escape_help(metric.documentation)}")
                lines.append(f"# TYPE {metric.name} {metric.type}")
                lines.extend(_sample_line(s.name, s.labels, s.value) for s in metric.samples)
        return ("\n".join(lines) + "\n").encode()


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _sample_line(name: str, labels: dict[str, str], value: float) -> str:
    if labels:
        escaped = (
            v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
            for v in labels.values()
        )
        inner = ",".join(f'{k}="{v}"' for k, v in zip(labels, escaped, strict=True))
        name = f"{name}{{{inner}}}"
    return f"{name} {_number(value)}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))
