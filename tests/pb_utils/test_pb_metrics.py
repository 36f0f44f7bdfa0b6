"""pb_utils metrics over a real worker link: frames to the server's CustomMetrics and back.

The "server" here is a thread that reads the worker's frames from the other end of
a socketpair and hands them to the real core handler (server/core/telemetry/metrics.py), as the
worker client does, then renders the Prometheus text the metrics endpoint serves.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dlserve import pb_utils as pb_utils
from dlserve.ipc import codec
from dlserve.ipc import messages as m
from dlserve.ipc.channel import BlockingChannel, ChannelClosed
from dlserve.server.core.telemetry.metrics import Metrics
from dlserve.worker.link import link


@dataclass
class FakeServer:
    channel: BlockingChannel[m.WorkerToServer]
    metrics: Metrics = field(default_factory=lambda: Metrics(lambda: []))
    before_reply: Callable[[], None] = lambda: None
    answer: bool = True

    def run(self) -> None:
        while True:
            try:
                msg, _ = self.channel.recv()
            except (ChannelClosed, OSError):
                return
            assert isinstance(msg, m.MetricFamilyDef | m.MetricOp | m.MetricValueCall)
            reply = self.metrics.custom.handle(msg)
            if reply is not None and self.answer:
                self.before_reply()
                self.channel.send(reply)

    def text(self) -> str:
        return self.metrics.render().decode()


@pytest.fixture
def server(worker_runtime: object) -> Iterator[tuple[FakeServer, link.WorkerLink]]:
    ours, theirs = socket.socketpair()
    worker = link.WorkerLink(BlockingChannel(ours, codec.to_worker))
    fake = FakeServer(BlockingChannel(theirs, codec.to_server))
    thread = threading.Thread(target=fake.run, daemon=True)
    thread.start()
    link.install(worker)
    try:
        yield fake, worker
    finally:
        link.uninstall(worker)
        ours.shutdown(socket.SHUT_RDWR)
        thread.join(timeout=10)
        ours.close()
        theirs.close()


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the Prometheus text, found by its name and labels."""
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == name and found.labels == labels:
                return float(found.value)
    raise AssertionError(f"no sample {name}{labels} in:\n{text}")


def test_counter_gauge_histogram_reach_the_server(
    server: tuple[FakeServer, link.WorkerLink],
) -> None:
    fake, _ = server
    labels = {"model": "m", "version": "1"}
    counter = pb_utils.MetricFamily("t_requests", "requests", pb_utils.MetricFamily.COUNTER)
    gauge = pb_utils.MetricFamily("t_depth", "depth", pb_utils.MetricFamily.GAUGE)
    histogram = pb_utils.MetricFamily("t_size", "size", pb_utils.MetricFamily.HISTOGRAM)
    requests = counter.Metric(labels=labels)
    depth = gauge.Metric(labels=labels)
    size = histogram.Metric(labels=labels, buckets=[1.0, 10.0])
    requests.increment(2)
    requests.increment(0.5)
    depth.set(7)
    depth.increment(-3)
    size.observe(0.5)
    size.observe(5)
    size.observe(50)
    assert requests.value() == 2.5  # a synchronous round trip, after the updates
    assert depth.value() == 4
    text = fake.text()
    assert sample(text, "t_requests_total", **labels) == 2.5  # the parser names counters _total
    assert sample(text, "t_depth", **labels) == 4
    assert sample(text, "t_size_bucket", le="1.0", **labels) == 1
    assert sample(text, "t_size_bucket", le="10.0", **labels) == 2
    assert sample(text, "t_size_bucket", le="+Inf", **labels) == 3
    assert sample(text, "t_size_count", **labels) == 3
    assert sample(text, "t_size_sum", **labels) == 55.5


def test_metrics_of_one_family_are_apart_by_labels(
    server: tuple[FakeServer, link.WorkerLink],
) -> None:
    family = pb_utils.MetricFamily("t_by_label", "by label", pb_utils.MetricFamily.COUNTER)
    a, b = family.Metric(labels={"k": "a"}), family.Metric(labels={"k": "b"})
    unlabelled = family.Metric()
    a.increment(1)
    b.increment(5)
    assert (a.value(), b.value(), unlabelled.value()) == (1, 5, 0)


@pytest.mark.parametrize(
    ("kind", "operation", "message"),
    [
        (pb_utils.MetricFamily.COUNTER, lambda x: x.increment(-1), "incremented monotonically"),
        (pb_utils.MetricFamily.COUNTER, lambda x: x.set(1), "COUNTER does not support Set"),
        (pb_utils.MetricFamily.COUNTER, lambda x: x.observe(1), "COUNTER does not support Observe"),
        (pb_utils.MetricFamily.GAUGE, lambda x: x.observe(1), "GAUGE does not support Observe"),
        (pb_utils.MetricFamily.HISTOGRAM, lambda x: x.increment(1), "does not support Increment"),
        (pb_utils.MetricFamily.HISTOGRAM, lambda x: x.set(1), "HISTOGRAM does not support Set"),
        (pb_utils.MetricFamily.HISTOGRAM, lambda x: x.value(), "HISTOGRAM does not support Value"),
    ],
)
def test_tritons_rules_per_kind(
    server: tuple[FakeServer, link.WorkerLink],
    kind: pb_utils.MetricKind,
    operation: Callable[[pb_utils.Metric], object],
    message: str,
) -> None:
    family = pb_utils.MetricFamily(f"t_rules_{int(kind)}", "rules", kind)
    buckets = [1.0] if kind == pb_utils.MetricFamily.HISTOGRAM else None
    metric = family.Metric(labels={}, buckets=buckets)
    with pytest.raises(pb_utils.TritonModelException, match=message):
        operation(metric)


def test_metric_creation_refusals(server: tuple[FakeServer, link.WorkerLink]) -> None:
    counter = pb_utils.MetricFamily("t_refusals", "r", pb_utils.MetricFamily.COUNTER)
    histogram = pb_utils.MetricFamily("t_refusals_h", "r", pb_utils.MetricFamily.HISTOGRAM)
    refusals: list[tuple[Callable[[], object], str]] = [
        (lambda: counter.Metric(labels=["a"]), "Labels must be a dictionary"),  # type: ignore[arg-type]
        (lambda: counter.Metric(labels={"k": 1}), "must be a string"),  # type: ignore[dict-item]
        (lambda: counter.Metric(labels={"bad-name": "x"}), "Invalid label name"),
        (lambda: counter.Metric(buckets=[1.0]), "Unexpected buckets found"),
        (lambda: histogram.Metric(), "Missing required buckets"),
        (lambda: histogram.Metric(buckets=(1.0,)), "Buckets must be a list"),
        (lambda: histogram.Metric(buckets=[2.0, 1.0]), "strictly increasing"),
        (
            lambda: pb_utils.MetricFamily("bad name", "d", pb_utils.MetricFamily.GAUGE),
            "invalid name",
        ),
        (lambda: pb_utils.MetricFamily("ok", "d", 7), "kind must be"),  # type: ignore[arg-type]
    ]
    for attempt, message in refusals:
        with pytest.raises(pb_utils.TritonModelException, match=message):
            attempt()


def test_frames_that_arrive_during_a_call_are_queued_in_order(
    server: tuple[FakeServer, link.WorkerLink],
) -> None:
    fake, worker = server
    fake.before_reply = lambda: (
        fake.channel.send(m.Release([64])),
        fake.channel.send(m.Release([128])),
    )
    gauge = pb_utils.MetricFamily("t_queue", "q", pb_utils.MetricFamily.GAUGE).Metric()
    gauge.set(3)
    assert gauge.value() == 3
    first, _ = worker.recv()
    second, _ = worker.recv()
    assert first == m.Release([64])
    assert second == m.Release([128])


def test_a_call_without_answer_fails_at_its_deadline(
    server: tuple[FakeServer, link.WorkerLink],
) -> None:
    fake, worker = server
    fake.answer = False
    pb_utils.MetricFamily("t_silent", "s", pb_utils.MetricFamily.GAUGE).Metric()
    with pytest.raises(pb_utils.TritonModelException, match=r"did not answer within 0\.2 s"):
        worker.call(m.MetricValueCall(worker.next_call_id(), "t_silent", {}), timeout=0.2)


def test_a_call_from_another_thread_gets_its_answer(
    server: tuple[FakeServer, link.WorkerLink],
) -> None:
    """Threads a model starts may ask too: whoever waits reads the channel for everyone."""
    link.install(server[1], process_wide=True)  # as a worker process does
    gauge = pb_utils.MetricFamily("t_threaded", "t", pb_utils.MetricFamily.GAUGE).Metric()
    gauge.set(7.0)
    values: list[float] = []
    thread = threading.Thread(target=lambda: values.append(gauge.value()))
    thread.start()
    thread.join(timeout=10)
    assert values == [7.0]


@pytest.mark.parametrize("installed", ["worker_runtime", "no_worker"])
def test_metrics_outside_a_worker_say_so(installed: str, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue(installed)
    assert link.current() is None
    with pytest.raises(pb_utils.TritonModelException, match="only available in a model run"):
        pb_utils.MetricFamily("t_nowhere", "n", pb_utils.MetricFamily.COUNTER)
