"""Triton's request tracing, end to end: real servers started with --trace-config, driven
by tritonclient over gRPC and HTTP; the trace files are read after the server has exited
(everything collected is written at shutdown), never while it runs."""

from __future__ import annotations

import http.client
import json
import os
import queue
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm

from conftest import EXAMPLES, TEST_MODELS, RunningServer, repository_of, run_server
from dlserve.tensors import cuda_ipc

CORE = [
    "REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_INPUT_END",
    "COMPUTE_OUTPUT_START", "COMPUTE_END", "REQUEST_END", "INFER_RESPONSE_COMPLETE",
]  # fmt: skip
GRPC = ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", *CORE, "GRPC_SEND_START", "GRPC_SEND_END"]
HTTP = ["HTTP_RECV_START", "HTTP_RECV_END", *CORE, "HTTP_SEND_START", "HTTP_SEND_END"]
A = np.arange(4, dtype=np.float32)
B = np.ones(4, dtype=np.float32)


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return repository_of(
        tmp_path_factory.mktemp("trace_repo"), EXAMPLES / "add_sub", EXAMPLES / "ensemble_add_sub",
        EXAMPLES / "identity_bytes", TEST_MODELS / "double", TEST_MODELS / "bls_traced",
        TEST_MODELS / "repeat",
    )  # fmt: skip


def traced_server(repository: Path, trace_file: Path, *config: str) -> Any:
    args = [a for c in (*config, f"triton,file={trace_file}") for a in ("--trace-config", c)]
    return run_server(repository, *args)


class Traces:
    """A trace file's JSON array, grouped by trace id."""

    def __init__(self, path: Path) -> None:
        self.entries: list[dict[str, Any]] = json.loads(path.read_text())
        self.heads: dict[int, dict[str, Any]] = {}
        self.stamps: dict[int, list[tuple[str, int]]] = defaultdict(list)
        self.tensors: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for entry in self.entries:
            if "model_name" in entry:
                assert entry["id"] not in self.heads, "trace ids are unique"
                self.heads[entry["id"]] = entry
            elif "timestamps" in entry:
                self.stamps[entry["id"]].extend((t["name"], t["ns"]) for t in entry["timestamps"])
            else:
                self.tensors[entry["id"]].append(entry)

    def by_request(self) -> dict[str, int]:
        """Root traces (requests from clients) by request id."""
        return {
            h["request_id"]: i
            for i, h in self.heads.items()
            if "request_id" in h and "parent_id" not in h
        }

    def in_order(self, trace_id: int, names: list[str]) -> list[int]:
        """The trace's timestamps in ``names``' order; they must be exactly those names."""
        stamps = dict(self.stamps[trace_id])
        assert sorted(stamps) == sorted(names) and len(self.stamps[trace_id]) == len(names)
        return [stamps[n] for n in names]


def grpc_inputs(a: np.ndarray, b: np.ndarray) -> list[grpcclient.InferInput]:
    inputs = []
    for name, value in (("INPUT0", a), ("INPUT1", b)):
        tensor = grpcclient.InferInput(name, list(value.shape), "FP32")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


def http_inputs(a: np.ndarray, b: np.ndarray, binary: bool = True) -> list[httpclient.InferInput]:
    inputs = []
    for name, value in (("INPUT0", a), ("INPUT1", b)):
        tensor = httpclient.InferInput(name, list(value.shape), "FP32")
        tensor.set_data_from_numpy(value, binary_data=binary)
        inputs.append(tensor)
    return inputs


def infer_both(server: RunningServer, ids: list[str]) -> None:
    """Each id in turn over gRPC ("g...") or HTTP ("h...")."""
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    http = httpclient.InferenceServerClient(server.http_url)
    try:
        for request_id in ids:
            if request_id.startswith("g"):
                grpc.infer("add_sub", grpc_inputs(A, B), request_id=request_id)
            else:
                http.infer("add_sub", http_inputs(A, B), request_id=request_id)
    finally:
        grpc.close()
        http.close()


# -- TIMESTAMPS at rate 1 ------------------------------------------------------------------
def test_every_request_is_traced_with_every_timestamp_in_order(
    repository: Path, tmp_path: Path
) -> None:
    trace_file = tmp_path / "trace.json"
    ids = [f"{p}{i}" for i in range(4) for p in ("g", "h")]
    with traced_server(repository, trace_file, "level=TIMESTAMPS", "rate=1") as server:
        infer_both(server, ids)
    traces = Traces(trace_file)
    by_request = traces.by_request()
    assert sorted(by_request) == sorted(ids) and len(traces.heads) == len(ids)
    for request_id, trace_id in by_request.items():
        head = traces.heads[trace_id]
        assert (head["model_name"], head["model_version"]) == ("add_sub", 1)
        assert "parent_id" not in head
        ordered = traces.in_order(trace_id, GRPC if request_id.startswith("g") else HTTP)
        assert ordered == sorted(ordered), f"{request_id}: {ordered}"
    print(f"{len(ids)} traces, e.g. {traces.stamps[by_request['g0']]}")


def test_stream_requests_are_traced(repository: Path, tmp_path: Path) -> None:
    """ModelStreamInfer: a model that answers once, and a decoupled one (3 responses: each
    stamps INFER_RESPONSE_COMPLETE and its sending)."""
    trace_file = tmp_path / "trace.json"
    results: queue.Queue[Any] = queue.Queue()
    with traced_server(repository, trace_file, "level=TIMESTAMPS", "rate=1") as server:
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        grpc.start_stream(callback=lambda result, error: results.put(error or result))
        grpc.async_stream_infer("add_sub", grpc_inputs(A, B), request_id="once")
        assert not isinstance(results.get(timeout=60), Exception)
        count = grpcclient.InferInput("COUNT", [1], "INT32")
        count.set_data_from_numpy(np.array([3], dtype=np.int32))
        grpc.async_stream_infer("repeat", [count], request_id="three")
        for _ in range(3):
            assert not isinstance(results.get(timeout=60), Exception)
        grpc.stop_stream()
        grpc.close()
    traces = Traces(trace_file)
    by_request = traces.by_request()
    ordered = traces.in_order(by_request["once"], GRPC)
    assert ordered == sorted(ordered)
    names = [name for name, _ in traces.stamps[by_request["three"]]]
    assert sorted(set(names)) == sorted(GRPC)
    assert [names.count(n) for n in ("INFER_RESPONSE_COMPLETE", "GRPC_SEND_END")] == [3, 3]
    stamps = dict(traces.stamps[by_request["three"]])  # the last of each name
    assert stamps["REQUEST_START"] <= stamps["QUEUE_START"] <= stamps["COMPUTE_START"]
    assert stamps["COMPUTE_START"] <= stamps["COMPUTE_END"] <= stamps["REQUEST_END"]
    print("decoupled stream trace:", traces.stamps[by_request["three"]])


def test_http_generate_requests_are_traced(repository: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.json"
    with traced_server(repository, trace_file, "level=TIMESTAMPS", "rate=1") as server:
        once = _post(server, "/v2/models/add_sub/generate", {"INPUT0": [1], "INPUT1": [2]})
        assert json.loads(once)["OUTPUT0"] == 3.0
        stream = _post(server, "/v2/models/repeat/generate_stream", {"COUNT": 2})
        assert stream.count(b"data: ") == 2
    traces = Traces(trace_file)
    by_model = {h["model_name"]: i for i, h in traces.heads.items()}
    ordered = traces.in_order(by_model["add_sub"], HTTP)
    assert ordered == sorted(ordered)
    names = [name for name, _ in traces.stamps[by_model["repeat"]]]
    assert sorted(set(names)) == sorted(HTTP)
    assert [names.count(n) for n in ("INFER_RESPONSE_COMPLETE", "HTTP_SEND_END")] == [2, 2]


def _post(server: RunningServer, path: str, body: object) -> bytes:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        connection.request("POST", path, json.dumps(body).encode())
        response = connection.getresponse()
        assert response.status == 200
        return response.read()
    finally:
        connection.close()


# -- rate, count, per-model settings, run-time updates ----------------------------------
def test_rate_traces_one_request_in_n(repository: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.json"
    ids = [f"g{i}" for i in range(1, 10)]
    with traced_server(repository, trace_file, "level=TIMESTAMPS", "rate=3") as server:
        infer_both(server, ids)
    traced = sorted(Traces(trace_file).by_request())
    assert traced == ["g3", "g6", "g9"]  # every 3rd request, counted from the first
    print("rate=3 traced", traced)


def test_count_stops_tracing_and_the_api_counts_down(repository: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.json"
    config = ("level=TIMESTAMPS", "rate=1", "count=2")
    with traced_server(repository, trace_file, *config) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        http = httpclient.InferenceServerClient(server.http_url)
        seen = [http.get_trace_settings()["trace_count"]]
        for request_id in ("g1", "g2", "g3", "g4"):
            client.infer("add_sub", grpc_inputs(A, B), request_id=request_id)
            count = client.get_trace_settings(as_json=True)["settings"]["trace_count"]["value"]
            seen.append(count[0])
        client.close()
    assert seen == ["2", "1", "0", "0", "0"]
    # Triton writes the traces of a count that ran out to <file>.0 at once
    assert not trace_file.exists()
    assert sorted(Traces(Path(f"{trace_file}.0")).by_request()) == ["g1", "g2"]
    print("trace_count seen over the API:", seen)


def test_model_settings_and_run_time_updates(repository: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.json"
    with traced_server(repository, trace_file) as server:  # level OFF, a file to write to
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        http = httpclient.InferenceServerClient(server.http_url)
        x = grpcclient.InferInput("INPUT0", [4], "FP32")
        x.set_data_from_numpy(A)

        def both(tag: str) -> None:
            grpc.infer("add_sub", grpc_inputs(A, B), request_id=f"add_sub-{tag}")
            grpc.infer("double", [x], request_id=f"double-{tag}")

        both("off")
        http.update_trace_settings("double", {"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
        both("model-on")
        grpc.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
        http.update_trace_settings("double", {"trace_level": ["OFF"]})
        both("global-on")
        grpc.update_trace_settings(settings={"trace_level": ["OFF"]})
        both("all-off")
        grpc.close()
        http.close()
    traced = sorted(Traces(trace_file).by_request())
    assert traced == ["add_sub-global-on", "double-model-on"]
    print("traced after run-time updates:", traced)


# -- log_frequency -----------------------------------------------------------------------
def test_log_frequency_rotates_numbered_files(repository: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.json"
    ids = ["g1", "h2", "g3", "h4", "g5"]
    config = ("level=TIMESTAMPS", "rate=1", "triton,log-frequency=2")
    with traced_server(repository, trace_file, *config) as server:
        infer_both(server, ids)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["trace.json.0", "trace.json.1", "trace.json.2"]
    parts = [sorted(Traces(tmp_path / name).by_request()) for name in files]
    assert [len(p) for p in parts] == [2, 2, 1]
    assert sorted(i for part in parts for i in part) == sorted(ids)
    print("log_frequency=2:", dict(zip(files, parts, strict=True)))


# -- TENSORS -------------------------------------------------------------------------------
def test_tensors_of_wire_requests(repository: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.json"
    config = ("level=TENSORS", "level=TIMESTAMPS", "rate=1")
    with traced_server(repository, trace_file, *config) as server:
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        http = httpclient.InferenceServerClient(server.http_url)
        grpc.infer("add_sub", grpc_inputs(A, B), request_id="grpc")
        http.infer("add_sub", http_inputs(A, B, binary=False), request_id="json")
        words = np.array([b"ab", b"c"], dtype=np.object_)
        text = grpcclient.InferInput("INPUT0", [2], "BYTES")
        text.set_data_from_numpy(words)
        grpc.infer("identity_bytes", [text], request_id="bytes")
        _infer_from_shared_memory(grpc)
        grpc.close()
        http.close()
    traces = Traces(trace_file)
    by_request = traces.by_request()
    for request_id in ("grpc", "json"):
        tensors = {(e["activity"], e["tensor"]["name"]): e["tensor"]
                   for e in traces.tensors[by_request[request_id]]}  # fmt: skip
        assert tensors == {
            ("TENSOR_QUEUE_INPUT", "INPUT0"): _tensor("INPUT0", "0,1,2,3"),
            ("TENSOR_QUEUE_INPUT", "INPUT1"): _tensor("INPUT1", "1,1,1,1"),
            ("TENSOR_BACKEND_OUTPUT", "OUTPUT0"): _tensor("OUTPUT0", "1,2,3,4"),
            ("TENSOR_BACKEND_OUTPUT", "OUTPUT1"): _tensor("OUTPUT1", "-1,0,1,2"),
        }
    bytes_in = traces.tensors[by_request["bytes"]][0]["tensor"]
    assert bytes_in == {"name": "INPUT0", "data": '"ab","c"', "shape": "2", "dtype": "BYTES"}
    shm_in = traces.tensors[by_request["shm"]]
    # the server does not hold a client region's bytes: no data
    in_data = {e["tensor"]["name"]: "data" in e["tensor"] for e in shm_in}
    assert in_data == {"INPUT0": False, "INPUT1": False, "OUTPUT0": False, "OUTPUT1": True}
    print("TENSORS:", traces.tensors[by_request["grpc"]])


def _tensor(name: str, data: str) -> dict[str, str]:
    return {"name": name, "data": data, "shape": "4", "dtype": "FP32"}


def _infer_from_shared_memory(client: grpcclient.InferenceServerClient) -> None:
    """Both inputs and OUTPUT0 in a system region, OUTPUT1 in the response."""
    key = f"/trace_in_{os.getpid()}"
    handle = shm.create_shared_memory_region("trace_in", key, 48)
    try:
        shm.set_shared_memory_region(handle, [A, B])
        client.register_system_shared_memory("trace_in", key, 48)
        inputs = grpc_inputs(A, B)
        inputs[0].set_shared_memory("trace_in", 16)
        inputs[1].set_shared_memory("trace_in", 16, offset=16)
        outputs = [grpcclient.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
        outputs[0].set_shared_memory("trace_in", 16, offset=32)
        client.infer("add_sub", inputs, outputs=outputs, request_id="shm")
        client.unregister_system_shared_memory("trace_in")
    finally:
        shm.destroy_shared_memory_region(handle)


# -- children: ensemble steps, BLS calls ---------------------------------------------------
def test_ensemble_steps_and_bls_calls_carry_the_parent_id(repository: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.json"
    with traced_server(repository, trace_file, "level=TIMESTAMPS", "rate=1") as server:
        grpc = grpcclient.InferenceServerClient(server.grpc_url)
        grpc.infer("ensemble_add_sub", grpc_inputs(A, B), request_id="ensemble")
        x = grpcclient.InferInput("INPUT0", [4], "FP32")
        x.set_data_from_numpy(A)
        result = grpc.infer("bls_traced", [x], request_id="bls")
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A * 2)
        grpc.close()
    traces = Traces(trace_file)
    by_request = traces.by_request()
    children: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for head in traces.heads.values():
        if "parent_id" in head:
            children[head["parent_id"]].append(head)
    steps = children[by_request["ensemble"]]
    assert [s["model_name"] for s in steps] == ["add_sub"] * 3
    for step in steps:
        ordered = traces.in_order(step["id"], CORE[:-1])  # no frontend, no response callback
        assert ordered == sorted(ordered)
    calls = children[by_request["bls"]]  # the call made without trace= is not traced
    assert [(c["model_name"], c["request_id"]) for c in calls] == [("double", "child")]
    assert len(traces.heads) == 2 + 3 + 1
    print("ensemble children:", steps, "BLS child:", calls)


# -- bad --trace-config ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "message"),
    [
        (["level=LOUD"], "invalid value for trace level option: LOUD"),
        (["rate=often"], 'Bad option: "--trace-config rate".'),
        (["rate=0"], 'Bad option: "--trace-config rate".'),
        (["count=-2"], 'Bad option: "--trace-config count".'),
        (["triton,log-frequency=x"], 'Bad option: "--trace-config triton,log-frequency".'),
        (["mode=opentelemetry"], "not supported by dlserve"),
        (["opentelemetry,url=localhost:4318"], "not supported by dlserve"),
        (["mode=zipkin"], "invalid value for trace mode option: zipkin"),
        (["level"], "--trace-config option format is '<trace mode>,<setting>=<value>'"),
        ([",file=x"], "No trace mode specified."),
        (["bogus=1"], 'Bad option: "--trace-config bogus".'),
        (["level=TIMESTAMPS"], "needs a trace file"),
        (["triton,file=/no/such/folder/t.json"], "does not exist or is not writable"),
    ],
)
def test_bad_trace_config_is_refused_at_start(config: list[str], message: str) -> None:
    args = [a for c in config for a in ("--trace-config", c)]
    done = subprocess.run(
        [sys.executable, "-m", "dlserve", "serve", "--model-repository", str(EXAMPLES), *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert message in done.stderr


def test_startup_settings_are_what_the_api_reports(repository: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.json"
    config = ("level=TIMESTAMPS", "level=TENSORS", "rate=5", "count=7",
              "triton,log-frequency=3", "mode=triton")  # fmt: skip
    with traced_server(repository, trace_file, *config) as server:
        http = httpclient.InferenceServerClient(server.http_url)
        settings = http.get_trace_settings()
        http.close()
    assert settings == {
        "trace_level": ["TIMESTAMPS", "TENSORS"], "trace_rate": "5", "trace_count": "7",
        "log_frequency": "3", "trace_file": str(trace_file), "trace_mode": "triton",
    }  # fmt: skip
    assert not trace_file.exists()  # nothing was traced: no file


def test_tritons_deprecated_trace_options_still_work(repository: Path, tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.json"
    args = (
        "--trace-file",
        str(trace_file),
        "--trace-level",
        "TIMESTAMPS",
        "--trace-rate",
        "1",
        "--trace-config",
        "rate=2",
    )  # fmt: skip: --trace-config overrides, as in Triton
    with run_server(repository, *args) as server:
        http = httpclient.InferenceServerClient(server.http_url)
        settings = http.get_trace_settings()
        http.close()
        infer_both(server, ["g1", "g2"])
    assert (settings["trace_level"], settings["trace_rate"]) == (["TIMESTAMPS"], "2")
    assert sorted(Traces(trace_file).by_request()) == ["g2"]


try:
    import tritonclient.utils.cuda_shared_memory as cudashm
except (ImportError, RuntimeError):  # needs cuda-python
    cudashm = None


@pytest.mark.gpu
@pytest.mark.skipif(cudashm is None or not cuda_ipc.available(), reason="no CUDA device")
def test_tensors_in_cuda_shared_memory_are_written_without_data(
    repository: Path, tmp_path: Path
) -> None:
    """The server does not map a client's CUDA region: name, shape and dtype, no data."""
    assert cudashm is not None
    trace_file = tmp_path / "trace.json"
    config = ("level=TENSORS", "rate=1")
    with traced_server(repository, trace_file, *config) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        region = cudashm.create_shared_memory_region("trace_cuda", 64, 0)
        try:
            cudashm.set_shared_memory_region(region, [A, B])
            client.register_cuda_shared_memory("trace_cuda", cudashm.get_raw_handle(region), 0, 64)
            inputs = grpc_inputs(A, B)
            inputs[0].set_shared_memory("trace_cuda", 16)
            inputs[1].set_shared_memory("trace_cuda", 16, offset=16)
            outputs = [grpcclient.InferRequestedOutput("OUTPUT0")]
            outputs[0].set_shared_memory("trace_cuda", 16, offset=32)
            client.infer("add_sub", inputs, outputs=outputs, request_id="cuda")
            client.unregister_cuda_shared_memory("trace_cuda")
        finally:
            cudashm.destroy_shared_memory_region(region)
            client.close()
    traces = Traces(trace_file)
    tensors = traces.tensors[traces.by_request()["cuda"]]
    assert {e["tensor"]["name"]: "data" in e["tensor"] for e in tensors} == {
        "INPUT0": False, "INPUT1": False, "OUTPUT0": False,
    }  # fmt: skip
