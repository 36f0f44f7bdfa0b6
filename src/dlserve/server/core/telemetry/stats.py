"""Per model-version statistics, counted as Triton counts them.

Counting is plain integer arithmetic on the request path; the Prometheus
endpoint and the statistics extension both read these counters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dlserve import errors
from dlserve.types import BatchStats, DurationStat, InferenceStats, ModelStatistics


@dataclass(slots=True)
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        if ns > 0:
            self.ns += ns

    def frozen(self) -> DurationStat:
        return DurationStat(self.count, self.ns)


@dataclass(slots=True)
class _Batch:
    compute_input: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    compute_output: _Duration = field(default_factory=_Duration)


@dataclass(slots=True)
class ModelStats:
    """Counters for one version of one model."""

    name: str
    version: str
    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    queue: _Duration = field(default_factory=_Duration)
    compute_input: _Duration = field(default_factory=_Duration)
    compute_infer: _Duration = field(default_factory=_Duration)
    compute_output: _Duration = field(default_factory=_Duration)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    failures_by_reason: dict[str, int] = field(default_factory=dict)
    cross_device: int = 0  # requests whose CUDA input is on a GPU without an instance
    batches: dict[int, _Batch] = field(default_factory=dict)
    pending: int = 0  # requests waiting in the scheduler's queue now
    cache_hit: _Duration = field(default_factory=_Duration)  # the response cache's
    cache_miss: _Duration = field(default_factory=_Duration)
    cache_enabled: bool = False  # the model uses the server's response cache

    def record_success(
        self,
        batch_size: int,
        total_ns: int,
        queue_ns: int,
        input_ns: int,
        infer_ns: int,
        output_ns: int,
    ) -> None:
        """A request that was executed alone."""
        self.record_request(batch_size, total_ns, queue_ns, input_ns, infer_ns, output_ns)
        self.record_execution(batch_size, input_ns, infer_ns, output_ns)

    def record_request(
        self,
        batch_size: int,
        total_ns: int,
        queue_ns: int,
        input_ns: int,
        infer_ns: int,
        output_ns: int,
    ) -> None:
        """One successful request (``batch_size`` inferences), however it was executed."""
        for duration, ns in (
            (self.success, total_ns), (self.queue, queue_ns), (self.compute_input, input_ns),
            (self.compute_infer, infer_ns), (self.compute_output, output_ns),
        ):  # fmt: skip
            duration.count += 1
            if ns > 0:
                duration.ns += ns
        self.inference_count += batch_size
        self.last_inference_ms = time.time_ns() // 1_000_000

    def record_execution(
        self, batch_size: int, input_ns: int, infer_ns: int, output_ns: int
    ) -> None:
        """One execute() call of the model over ``batch_size`` inferences in all."""
        self.execution_count += 1
        batch = self.batches.get(batch_size)
        if batch is None:
            batch = self.batches[batch_size] = _Batch()
        for duration, ns in (
            (batch.compute_input, input_ns), (batch.compute_infer, infer_ns),
            (batch.compute_output, output_ns),
        ):  # fmt: skip
            duration.count += 1
            if ns > 0:
                duration.ns += ns

    def record_cache_hit(self, total_ns: int, queue_ns: int, hit_ns: int) -> None:
        """A request answered from the response cache, as Triton counts one: a success
        (with its queue time) that is not an inference nor an execution, and a hit."""
        self.success.add(total_ns)
        self.queue.add(queue_ns)
        self.cache_hit.add(hit_ns)

    def record_cache_miss(self, lookup_ns: int, insert_ns: int) -> None:
        """A request the cache did not have, executed (already recorded) and then stored:
        the insertion adds to its duration, as in Triton."""
        self.cache_miss.add(lookup_ns + insert_ns)
        if insert_ns > 0:
            self.success.ns += insert_ns

    def record_failure(self, total_ns: int, reason: str) -> None:
        """reason: Triton's failure label (REJECTED, CANCELED, BACKEND, OTHER)."""
        self.fail.add(total_ns)
        self.failures_by_reason[reason] = self.failures_by_reason.get(reason, 0) + 1
        self.last_inference_ms = time.time_ns() // 1_000_000

    def snapshot(self) -> ModelStatistics:
        inference = InferenceStats(
            success=self.success.frozen(),
            fail=self.fail.frozen(),
            queue=self.queue.frozen(),
            compute_input=self.compute_input.frozen(),
            compute_infer=self.compute_infer.frozen(),
            compute_output=self.compute_output.frozen(),
            cache_hit=self.cache_hit.frozen(),
            cache_miss=self.cache_miss.frozen(),
        )
        batches = tuple(
            BatchStats(
                size, b.compute_input.frozen(), b.compute_infer.frozen(), b.compute_output.frozen()
            )
            for size, b in sorted(self.batches.items())
        )
        return ModelStatistics(
            self.name,
            self.version,
            self.last_inference_ms,
            self.inference_count,
            self.execution_count,
            inference,
            batches,
        )


def failure_reason(exc: errors.DlserveError) -> str:
    """Triton's failure label for a request that failed with ``exc``."""
    return "REJECTED" if isinstance(exc, errors.InvalidArgumentError) else "BACKEND"
