"""Triton's sequence batcher through a real server, tritonclient gRPC and HTTP.

The model (tests/models/sequence_acc and its variants) keeps one running sum per
instance, reset by the START control input, so a sequence's sum is right only if all
its requests reach the instance its START went to; it reports its process id, the
control inputs it received, request.correlation_id(), request.flags() and
request.parameters(). A "gate" request holds an instance inside execute (FIFO
handshake) while the test queues others, seen through Triton's pending-request gauge.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import (
    TEST_MODELS,
    FifoGate,
    RunningServer,
    repository_of,
    run_server,
    wait_pending,
)

DEADLINE_S = 60.0
MODELS = ("sequence_acc", "sequence_acc_str", "sequence_acc_batched", "sequence_acc_idle",
          "sequence_oldest", "sequence_bls", "sequence_stream")  # fmt: skip
REPORTED = ("SUM", "PID", "START", "END", "READY", "CORRID", "ID", "FLAGS", "PARAMS")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    models = (TEST_MODELS / name for name in MODELS)
    repository = repository_of(tmp_path_factory.mktemp("sequence_repo"), *models)
    with run_server(repository, "--exit-on-error", "false") as running:  # sequence_oldest
        yield running


@pytest.fixture
def grpc(server: RunningServer) -> Iterator[grpcclient.InferenceServerClient]:
    with grpcclient.InferenceServerClient(server.grpc_url) as connected:
        yield connected


@pytest.fixture(params=["grpc", "http"])
def client(request: pytest.FixtureRequest, server: RunningServer) -> Iterator[Any]:
    if request.param == "grpc":
        with grpcclient.InferenceServerClient(server.grpc_url) as connected:
            yield connected
    else:
        with httpclient.InferenceServerClient(server.http_url) as connected:
            yield connected


def _inputs(client: Any, value: int, batch: int = 0) -> list[Any]:
    module = grpcclient if isinstance(client, grpcclient.InferenceServerClient) else httpclient
    data = np.full([batch, 1] if batch else [1], value, np.int32)
    tensor = module.InferInput("INPUT", list(data.shape), "INT32")
    tensor.set_data_from_numpy(data)
    return [tensor]


def _report(result: Any) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for name in REPORTED:
        value = result.as_numpy(name).reshape(-1)[0]
        seen[name] = value.decode() if isinstance(value, bytes) else value.item()
    return seen


def infer(client: Any, model: str, value: int, batch: int = 0, **kwargs: Any) -> dict[str, Any]:
    """One request; what the model saw."""
    return _report(client.infer(model, _inputs(client, value, batch), **kwargs))


def fails(client: Any, model: str, value: int, **kwargs: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        client.infer(model, _inputs(client, value), **kwargs)
    print(f"{model} {kwargs}: {caught.value.status()} {caught.value.message()}")
    return caught.value


def _code(error: InferenceServerException) -> str:
    """The status as a name, whichever protocol said it."""
    status = str(error.status())
    return {"400": "INVALID_ARGUMENT", "499": "CANCELLED", "503": "UNAVAILABLE"}.get(
        status, status.removeprefix("StatusCode.")
    )


class Pending:
    """One asynchronous gRPC request of a sequence, and its outcome."""

    def __init__(self, client: Any, model: str, value: int, batch: int = 0, **kwargs: Any) -> None:
        self._results: queue.Queue[Any] = queue.Queue()
        inputs = _inputs(client, value, batch)
        self.call = client.async_infer(model, inputs, self._done, **kwargs)

    def _done(self, result: Any, error: Any) -> None:
        self._results.put(error if error is not None else result)

    def outcome(self) -> Any:
        return self._results.get(timeout=DEADLINE_S)

    def result(self) -> dict[str, Any]:
        outcome = self.outcome()
        if isinstance(outcome, Exception):
            raise outcome
        return _report(outcome)


class Gate:
    """A request of a sequence that holds its instance inside execute until released."""

    def __init__(
        self, client: Any, model: str, folder: Path, value: int, batch: int = 0, **kwargs: Any
    ) -> None:
        self.fifos = FifoGate(folder)
        parameters = self.fifos.parameters
        self.request = Pending(client, model, value, batch, parameters=parameters, **kwargs)
        self.fifos.wait_started(DEADLINE_S)

    def release(self) -> dict[str, Any]:
        self.fifos.open()
        return self.request.result()


def counts(grpc: Any, model: str) -> tuple[int, int, dict[int, int]]:
    """inference_count, execution_count, and executions per batch size."""
    stats = grpc.get_inference_statistics(model, as_json=True)["model_stats"][0]
    batches = {
        int(b["batch_size"]): int(b["compute_infer"].get("count", 0))
        for b in stats.get("batch_stats", [])
    }
    return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0)), batches


# -- affinity and what the model sees -------------------------------------------------------
def test_interleaved_sequences_keep_their_own_instance_and_sum(client: Any, grpc: Any) -> None:
    before = counts(grpc, "sequence_acc")
    a, b = 1001, 1002
    steps = [  # (sequence, value, start, end): the two sequences interleaved
        (a, 1, True, False), (b, 10, True, False), (a, 2, False, False),
        (b, 20, False, False), (a, 3, False, True), (b, 30, False, True),
    ]  # fmt: skip
    seen: dict[int, list[dict[str, Any]]] = {a: [], b: []}
    for sequence, value, start, end in steps:
        report = infer(client, "sequence_acc", value, sequence_id=sequence,
                       sequence_start=start, sequence_end=end)  # fmt: skip
        seen[sequence].append(report)
    for sequence, reports in seen.items():
        print(sequence, [(r["SUM"], r["PID"]) for r in reports])
    assert [r["SUM"] for r in seen[a]] == [1, 3, 6]
    assert [r["SUM"] for r in seen[b]] == [10, 30, 60]
    assert len({r["PID"] for r in seen[a]}) == 1 and len({r["PID"] for r in seen[b]}) == 1
    assert seen[a][0]["PID"] != seen[b][0]["PID"]  # two instances, one sequence each
    after = counts(grpc, "sequence_acc")
    assert (after[0] - before[0], after[1] - before[1]) == (6, 6)
    assert after[2][1] - before[2].get(1, 0) == 6  # six executions of one request


def test_the_model_sees_the_control_inputs_id_and_flags(client: Any) -> None:
    sequence = 42
    first = infer(client, "sequence_acc", 1, sequence_id=sequence, sequence_start=True)
    middle = infer(client, "sequence_acc", 1, sequence_id=sequence)
    last = infer(client, "sequence_acc", 1, sequence_id=sequence, sequence_end=True)
    alone = infer(client, "sequence_acc", 5, sequence_id=43, sequence_start=True,
                  sequence_end=True)  # fmt: skip
    for name, report in (("first", first), ("middle", middle), ("last", last), ("alone", alone)):
        print(name, report)
    expected = {"START": 1, "END": 0.0, "READY": True, "CORRID": "42", "ID": "42",
                "FLAGS": 1, "PARAMS": "{}"}  # fmt: skip
    assert {k: first[k] for k in expected} == expected  # sequence_* parameters consumed
    assert (middle["START"], middle["END"], middle["FLAGS"], middle["SUM"]) == (0, 0.0, 0, 2)
    assert (last["START"], last["END"], last["FLAGS"], last["SUM"]) == (0, 1.0, 2, 3)
    assert (alone["START"], alone["END"], alone["FLAGS"], alone["ID"]) == (1, 1.0, 3, "43")
    assert alone["SUM"] == 5


def test_sequences_bound_to_one_instance_share_an_execute(
    grpc: Any, server: RunningServer, tmp_path: Path
) -> None:
    """max_batch_size 4: four slots on the one instance. While sequence 501 holds it, the
    first requests of 502 and 503 wait, then go to the model in one execute (one request
    per sequence), which the statistics count as one execution of batch size 2."""
    model = "sequence_acc_batched"
    before = counts(grpc, model)
    gate = Gate(grpc, model, tmp_path, 1, batch=1, sequence_id=501, sequence_start=True)
    waiting = [Pending(grpc, model, 10, 1, sequence_id=s, sequence_start=True) for s in (502, 503)]
    wait_pending(server, model, 2)
    gate.release()
    results = [p.result() for p in waiting]
    print([(r["CORRID"], r["START"], r["PID"]) for r in results])
    assert [(r["CORRID"], r["START"]) for r in results] == [("502", 1), ("503", 1)]
    after = counts(grpc, model)
    print("statistics:", after, "before:", before)
    assert (after[0] - before[0], after[1] - before[1]) == (3, 2)
    assert after[2].get(2, 0) - before[2].get(2, 0) == 1
    for sequence in (501, 502, 503):
        infer(grpc, model, 0, batch=1, sequence_id=sequence, sequence_end=True)


def test_string_ids_reach_the_model_as_strings(client: Any) -> None:
    first = infer(client, "sequence_acc_str", 4, sequence_id="user-7", sequence_start=True)
    last = infer(client, "sequence_acc_str", 5, sequence_id="user-7", sequence_end=True)
    print(first, last)
    assert (first["ID"], first["CORRID"], first["FLAGS"]) == ("'user-7'", "user-7", 1)
    assert (last["SUM"], last["FLAGS"]) == (9, 2)
    # the same text as an id of the integer-id model is refused, and the other way round
    error = fails(client, "sequence_acc", 1, sequence_id="user-7", sequence_start=True)
    assert _code(error) == "INVALID_ARGUMENT"
    assert error.message() == (
        "sequence batching control 'CORRID' data-type is 'BYTES', but model "
        "'sequence_acc' expects 'UINT64'"
    )
    error = fails(client, "sequence_acc_str", 1, sequence_id=7, sequence_start=True)
    assert "data-type is 'UINT64', but model 'sequence_acc_str' expects 'BYTES'" in (
        error.message()
    )


def test_a_batching_model_gets_control_inputs_with_a_batch_dimension(client: Any) -> None:
    first = infer(client, "sequence_acc_batched", 3, batch=1, sequence_id=2**32 + 5,
                  sequence_start=True)  # fmt: skip
    last = infer(client, "sequence_acc_batched", 4, batch=1, sequence_id=2**32 + 5,
                 sequence_end=True)  # fmt: skip
    print(first, last)
    # CORRID is TYPE_INT32: the low 32 bits of the id, as Triton copies them
    assert (first["START"], first["READY"], first["CORRID"], first["SUM"]) == (1, 1.0, "5", 3)
    assert (last["START"], last["FLAGS"], last["SUM"]) == (0, 2, 7)
    with pytest.raises(InferenceServerException) as caught:
        client.infer("sequence_acc_batched", _inputs(client, 1, batch=2), sequence_id=9,
                     sequence_start=True)  # fmt: skip
    assert caught.value.message() == (
        "inference request to model 'sequence_acc_batched' must specify batch-size 1 due to "
        "requirements of sequence batcher"
    )


def test_bls_passes_the_id_and_flags_to_a_stateful_model(client: Any) -> None:
    """sequence_bls has no sequence batching: Triton gives it the id and flags anyway, and
    its BLS requests with correlation_id= and flags= are a sequence of sequence_acc."""

    def call(value: int, **kwargs: Any) -> dict[str, Any]:
        result = client.infer("sequence_bls", _inputs(client, value), sequence_id=900, **kwargs)
        seen = {}
        for name in ("SUM", "ID", "FLAGS", "MY_ID", "MY_FLAGS"):
            item = result.as_numpy(name).reshape(-1)[0]
            seen[name] = item.decode() if isinstance(item, bytes) else item.item()
        return seen

    reports = [call(4, sequence_start=True), call(5), call(6, sequence_end=True)]
    print(reports)
    assert [r["SUM"] for r in reports] == [4, 9, 15]
    assert [r["FLAGS"] for r in reports] == [r["MY_FLAGS"] for r in reports] == [1, 0, 2]
    assert {r["ID"] for r in reports} == {r["MY_ID"] for r in reports} == {"900"}
    error = fails(client, "sequence_bls", 1, sequence_id=900)  # the sequence has ended
    assert "for sequence 900 to model 'sequence_acc' must specify the START flag" in (
        error.message()
    )


def test_a_decoupled_model_streams_a_sequence(server: RunningServer) -> None:
    results: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        steps = ((3, {"sequence_start": True}), (4, {}), (5, {"sequence_end": True}))
        for value, flags in steps:
            client.async_stream_infer(
                "sequence_stream", _inputs(client, value), sequence_id="s-1", **flags
            )
        sums = []
        for _ in range(6):  # two responses per request, in order: one instance, one slot
            result, error = results.get(timeout=DEADLINE_S)
            assert error is None, error
            sums.append(int(result.as_numpy("SUM")[0]))
        client.async_stream_infer("sequence_stream", _inputs(client, 1), sequence_id="s-1")
        result, error = results.get(timeout=DEADLINE_S)
        client.stop_stream()
    print(sums, error)
    assert sums == [0, 3, 3, 7, 7, 12]
    assert error is not None and "must specify the START flag" in error.message()


# -- Triton's errors ----------------------------------------------------------------------
def test_requests_without_a_sequence_are_refused(client: Any) -> None:
    error = fails(client, "sequence_acc", 1)
    assert _code(error) == "INVALID_ARGUMENT"
    assert error.message() == (
        "inference request to model 'sequence_acc' must specify a non-zero or non-empty "
        "correlation ID"
    )
    error = fails(client, "sequence_acc", 1, sequence_id=777)
    assert _code(error) == "INVALID_ARGUMENT"
    assert error.message() == (
        "inference request for sequence 777 to model 'sequence_acc' must specify the START "
        "flag on the first request of the sequence"
    )
    error = fails(client, "sequence_acc_str", 1, sequence_id="nobody", sequence_end=True)
    assert "for sequence nobody to model 'sequence_acc_str' must specify the START flag" in (
        error.message()
    )


def test_an_ended_sequence_takes_no_more_requests(client: Any) -> None:
    infer(client, "sequence_acc", 1, sequence_id=55, sequence_start=True, sequence_end=True)
    error = fails(client, "sequence_acc", 1, sequence_id=55)
    assert "must specify the START flag" in error.message()


def test_a_second_start_restarts_the_sequence_on_its_instance(client: Any) -> None:
    """Triton's behaviour: a START for an active id is a conflict it logs; the new
    sequence goes on in the same slot (the model sees START again)."""
    first = infer(client, "sequence_acc", 5, sequence_id=66, sequence_start=True)
    again = infer(client, "sequence_acc", 7, sequence_id=66, sequence_start=True)
    last = infer(client, "sequence_acc", 1, sequence_id=66, sequence_end=True)
    print(first, again, last)
    assert (first["SUM"], again["SUM"], last["SUM"]) == (5, 7, 8)
    assert first["PID"] == again["PID"] == last["PID"]


def test_an_idle_sequence_loses_its_slot(client: Any) -> None:
    """max_sequence_idle_microseconds is 1: the sequence is idle once its request has
    gone to the instance. Its next request needs a START; the model's only slot is free
    for another sequence (which would otherwise wait for the first one's END)."""
    infer(client, "sequence_acc_idle", 1, sequence_id=7, sequence_start=True)
    error = fails(client, "sequence_acc_idle", 2, sequence_id=7)
    assert _code(error) == "INVALID_ARGUMENT"
    assert "inference request for sequence 7 to model 'sequence_acc_idle' must specify the " \
        "START flag" in error.message()  # fmt: skip
    other = infer(client, "sequence_acc_idle", 3, sequence_id=8, sequence_start=True)
    assert other["SUM"] == 3


def test_a_cancelled_request_ends_its_sequence_and_frees_the_slot(
    grpc: Any, server: RunningServer, tmp_path: Path
) -> None:
    # sequence 1 holds an instance; its second request waits behind it, then is cancelled
    gate = Gate(grpc, "sequence_acc", tmp_path, 1, sequence_id=301, sequence_start=True)
    doomed = Pending(grpc, "sequence_acc", 2, sequence_id=301)
    wait_pending(server, "sequence_acc", 1)
    doomed.call.cancel()
    wait_pending(server, "sequence_acc", 0)
    assert "CANCELLED" in str(doomed.outcome().status())
    assert gate.release()["SUM"] == 1
    error = fails(grpc, "sequence_acc", 3, sequence_id=301)  # the sequence is over
    assert "must specify the START flag" in error.message()
    # both slots are free: two new sequences run at once, each on its own instance
    gates = [Gate(grpc, "sequence_acc", tmp_path, 10 * i, sequence_id=310 + i,
                  sequence_start=True) for i in (1, 2)]  # fmt: skip
    results = [g.release() for g in gates]
    print("after the cancel:", [(r["SUM"], r["PID"]) for r in results])
    assert [r["SUM"] for r in results] == [10, 20]
    assert results[0]["PID"] != results[1]["PID"]
    for i in (1, 2):
        infer(grpc, "sequence_acc", 0, sequence_id=310 + i, sequence_end=True)


def test_a_third_sequence_waits_in_the_backlog_for_a_slot(
    grpc: Any, server: RunningServer, tmp_path: Path
) -> None:
    """Two instances, one slot each: a third sequence waits until one of them ends."""
    gate = Gate(grpc, "sequence_acc", tmp_path, 1, sequence_id=401, sequence_start=True)
    infer(grpc, "sequence_acc", 2, sequence_id=402, sequence_start=True)
    third = Pending(grpc, "sequence_acc", 3, sequence_id=403, sequence_start=True)
    wait_pending(server, "sequence_acc", 1)
    ended = infer(grpc, "sequence_acc", 5, sequence_id=402, sequence_end=True)
    result = third.result()
    print("ended:", ended, "third:", result)
    assert (ended["SUM"], result["SUM"]) == (7, 3)  # 403 took 402's slot and sum's reset
    assert result["PID"] == ended["PID"]
    assert gate.release()["SUM"] == 1
    for sequence in (401, 403):
        infer(grpc, "sequence_acc", 0, sequence_id=sequence, sequence_end=True)


# -- configuration ---------------------------------------------------------------------------
def test_an_unsupported_sequence_option_makes_the_model_unavailable(grpc: Any) -> None:
    rows = grpc.get_model_repository_index(as_json=True)["models"]
    row = next(r for r in rows if r["name"] == "sequence_oldest")
    print(row)
    assert row["state"] == "UNAVAILABLE"
    assert row["reason"] == (
        "model 'sequence_oldest': sequence_batching 'oldest' (several sequences batched into "
        "one execute) is not supported by dlserve (supported: the direct strategy with "
        "control inputs START, END, READY and CORRID, and max_sequence_idle_microseconds; "
        "iterative_sequence without control inputs)"
    )
    assert not grpc.is_model_ready("sequence_oldest")


def test_the_config_shows_triton_default_idle_time(grpc: Any) -> None:
    config = grpc.get_model_config("sequence_acc_batched", as_json=True)["config"]
    assert int(config["sequence_batching"]["max_sequence_idle_microseconds"]) == 1_000_000


# -- unload ----------------------------------------------------------------------------------
def test_unload_runs_what_is_queued_and_does_not_wait_for_open_sequences(
    tmp_path: Path,
) -> None:
    """Sequence 1 is open (no END) and idle; sequence 2 has a request executing and one
    queued behind it. Unloading finishes sequence 2's requests, does not wait for sequence
    1's END (the drain limit is 30 s), and after a reload no sequence survives."""
    repository = repository_of(tmp_path / "repo", TEST_MODELS / "sequence_acc")
    with (
        run_server(repository, "--model-control-mode", "explicit") as server,
        grpcclient.InferenceServerClient(server.grpc_url) as grpc,
    ):
        grpc.load_model("sequence_acc")
        infer(grpc, "sequence_acc", 1, sequence_id=1, sequence_start=True)
        gate = Gate(grpc, "sequence_acc", tmp_path, 5, sequence_id=2, sequence_start=True)
        queued = Pending(grpc, "sequence_acc", 6, sequence_id=2)
        wait_pending(server, "sequence_acc", 1)
        unloading: queue.Queue[float] = queue.Queue()

        def unload() -> None:  # blocks while the gate holds the model: a thread of its own
            with grpcclient.InferenceServerClient(server.grpc_url) as own:
                own.unload_model("sequence_acc")
            unloading.put(time.monotonic())

        started = time.monotonic()
        threading.Thread(target=unload, daemon=True).start()
        assert gate.release()["SUM"] == 5
        assert queued.result()["SUM"] == 11  # ran before the version went away
        finished = unloading.get(timeout=DEADLINE_S)
        print(f"unloaded {finished - started:.2f} s after it was asked for")
        assert finished - started < 10.0
        assert not grpc.is_model_ready("sequence_acc")
        grpc.load_model("sequence_acc")
        error = fails(grpc, "sequence_acc", 1, sequence_id=1)
        assert "must specify the START flag" in error.message()
        assert infer(grpc, "sequence_acc", 3, sequence_id=1, sequence_start=True)["SUM"] == 3
