"""Triton's response cache through real servers and unmodified tritonclient (gRPC and HTTP).

The test model (tests/cache_models/cached) returns its instance's execution count as
OUTPUT1, and the statistics extension says how often it ran: a request answered from the
cache gets the counter of the execution that computed it, and execution_count stays.

- a repeated request is a hit (same outputs, no execution, cache_hit counted, a success that
  is not an inference); different bytes, shape or parameters miss; failures are not stored;
- the outputs asked for are part of the key; ``class_count`` is applied to a cached response;
- an ensemble step of a cached model is a hit while the ensemble request is not;
- LRU eviction at the configured size, with exact byte accounting; an entry larger than the
  cache is not stored;
- what Triton refuses or skips: no server cache (the model runs, uncached), decoupled and
  sequence models and an ensemble over a stateful step (refused at load), tensors in shared
  memory (not cached), models without response_cache; a top-level ensemble request is
  cached;
- a reload (new code, same version) or an unload drops the model's entries: nothing stale;
- concurrent identical requests all get the right answer and leave one entry;
- Triton's per-model and server-wide nv_cache_* metrics; bad --cache-config refused at start.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from conftest import ROOT, TEST_MODELS, RunningServer, repository_of, run_server
from dlserve.server.core.cache.response_cache import CachedTensor, packed_size
from dlserve.tensors import cuda_ipc

try:
    import tritonclient.utils.cuda_shared_memory as cudashm
except (ImportError, RuntimeError):  # needs cuda-python
    cudashm = None

CACHE_MODELS = ROOT / "tests" / "cache_models"
CACHE_BYTES = 1 << 20
DEADLINE_S = 60.0
RNG = np.random.default_rng(7)


def _repository(root: Path, *names: str) -> Path:
    return repository_of(root, *(CACHE_MODELS / name for name in names))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repository = _repository(tmp_path_factory.mktemp("cache_repo"), "cached", "uncached",
                             "cached_ensemble", "steps_ensemble")  # fmt: skip
    options = ("--cache-config", f"local,size={CACHE_BYTES}", "--model-control-mode", "explicit",
               "--load-model", "*")  # fmt: skip
    with run_server(repository, *options) as running:
        yield running


@pytest.fixture(params=["grpc", "http"])
def client(request: pytest.FixtureRequest, server: RunningServer) -> Iterator[Any]:
    yield from _client(request.param, server)


def _client(protocol: str, server: RunningServer) -> Iterator[Any]:
    if protocol == "grpc":
        with grpcclient.InferenceServerClient(server.grpc_url) as c:
            yield c
    else:
        c = httpclient.InferenceServerClient(server.http_url, concurrency=8)
        yield c
        c.close()


def _lib(client: Any) -> Any:
    return grpcclient if isinstance(client, grpcclient.InferenceServerClient) else httpclient


def infer(
    client: Any, data: np.ndarray, model: str = "cached", outputs: dict[str, int] | None = None,
    **parameters: Any,
) -> Any:  # fmt: skip
    lib = _lib(client)
    name = "IN" if model.endswith("_ensemble") else "INPUT0"
    tensor = lib.InferInput(name, list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    requested = None
    if outputs is not None:
        requested = [lib.InferRequestedOutput(n, class_count=k) for n, k in outputs.items()]
    return client.infer(model, [tensor], outputs=requested, parameters=parameters or None)


@dataclass(frozen=True)
class Stats:
    executions: int
    inferences: int
    success: int
    hits: int
    misses: int
    hit_ns: int
    miss_ns: int
    compute: int  # compute_infer's count: requests that ran
    fail: int


def stats(client: Any, model: str = "cached") -> Stats:
    if isinstance(client, grpcclient.InferenceServerClient):
        got = client.get_inference_statistics(model, as_json=True)
    else:
        got = client.get_inference_statistics(model)
    s = got["model_stats"][0]
    i = s["inference_stats"]

    def count(key: str) -> int:
        return int(i[key].get("count", 0))

    return Stats(
        int(s.get("execution_count", 0)), int(s.get("inference_count", 0)), count("success"),
        count("cache_hit"), count("cache_miss"), int(i["cache_hit"].get("ns", 0)),
        int(i["cache_miss"].get("ns", 0)), count("compute_infer"), count("fail"),
    )  # fmt: skip


def metrics(server: RunningServer) -> dict[str, float]:
    """Every sample of the metrics endpoint, by its name and labels as written."""
    with urllib.request.urlopen(server.metrics_url, timeout=DEADLINE_S) as response:
        text = response.read().decode()
    return {
        m[1]: float(m[2]) for m in re.finditer(r"^(\S+) (\S+)$", text, re.MULTILINE)
    }  # fmt: skip


def model_metric(name: str, model: str = "cached") -> str:
    return f'{name}{{model="{model}",version="1"}}'


def fresh(*shape: int) -> np.ndarray:
    """Input no other test sends: every test starts from a miss."""
    return RNG.standard_normal(shape).astype(np.float32)


# -- hits and misses ---------------------------------------------------------------------
def test_a_repeated_request_is_answered_from_the_cache(client: Any) -> None:
    data = fresh(2, 3)
    before = stats(client)
    first = infer(client, data)
    after_first = stats(client)
    second = infer(client, data)
    after = stats(client)
    print("miss then hit:", before, after_first, after)
    np.testing.assert_array_equal(first.as_numpy("OUTPUT0"), data * 2)
    np.testing.assert_array_equal(second.as_numpy("OUTPUT0"), first.as_numpy("OUTPUT0"))
    assert second.as_numpy("OUTPUT1")[0] == first.as_numpy("OUTPUT1")[0]  # not executed again
    assert after_first.misses == before.misses + 1 and after_first.hits == before.hits
    assert after.executions == after_first.executions == before.executions + 1
    assert after.hits == after_first.hits + 1 and after.misses == after_first.misses
    assert after.success == after_first.success + 1  # a hit is a successful request ...
    assert after.inferences == after_first.inferences  # ... but not an inference
    assert after.compute == after_first.compute  # nor an execution's compute time
    assert after.hit_ns > before.hit_ns and after_first.miss_ns > before.miss_ns


def test_different_bytes_shape_or_parameters_miss(client: Any) -> None:
    data = fresh(2, 3)
    infer(client, data)
    before = stats(client)
    reshaped = infer(client, data.reshape(3, 2))  # the same bytes, another shape
    other = infer(client, data + 1)
    offset = infer(client, data, offset=1)  # a parameter the model sees
    after = stats(client)
    assert reshaped.as_numpy("OUTPUT0").shape == (3, 2)
    np.testing.assert_array_equal(other.as_numpy("OUTPUT0"), (data + 1) * 2)
    np.testing.assert_array_equal(offset.as_numpy("OUTPUT0"), data * 2 + 1)
    assert (after.executions - before.executions, after.misses - before.misses) == (3, 3)
    assert after.hits == before.hits


def test_the_outputs_asked_for_are_part_of_the_key(client: Any) -> None:
    data = fresh(1, 4)
    only = infer(client, data, outputs={"OUTPUT0": 0})
    assert only.as_numpy("OUTPUT1") is None
    before = stats(client)
    both = infer(client, data, outputs={"OUTPUT0": 0, "OUTPUT1": 0})
    everything = infer(client, data)  # none named: every output, another key
    again = infer(client, data, outputs={"OUTPUT0": 0})
    after = stats(client)
    assert both.as_numpy("OUTPUT1") is not None and everything.as_numpy("OUTPUT1") is not None
    np.testing.assert_array_equal(again.as_numpy("OUTPUT0"), data * 2)
    assert again.as_numpy("OUTPUT1") is None
    assert (after.executions - before.executions, after.hits - before.hits) == (2, 1)


def test_class_count_is_applied_to_the_cached_response(client: Any) -> None:
    data = np.array([[0.5, 3.0, 1.0, 2.0]], dtype=np.float32) + np.float32(RNG.integers(1000))
    top2 = infer(client, data, outputs={"OUTPUT0": 2})
    before = stats(client)
    top3 = infer(client, data, outputs={"OUTPUT0": 3})
    raw = infer(client, data, outputs={"OUTPUT0": 0})
    after = stats(client)
    values = (data * 2)[0]
    order = np.argsort(-values, kind="stable")

    def top(k: int) -> list[bytes]:
        return [f"{values[i]:.6f}:{i}".encode() for i in order[:k]]

    assert top2.as_numpy("OUTPUT0").tolist() == top(2)
    assert top3.as_numpy("OUTPUT0").tolist() == top(3)
    np.testing.assert_array_equal(raw.as_numpy("OUTPUT0"), data * 2)
    assert (after.executions, after.hits - before.hits) == (before.executions, 2)


def test_failed_requests_are_not_stored(client: Any) -> None:
    data = fresh(1, 2)
    before = stats(client)
    for _ in range(2):
        with pytest.raises(InferenceServerException, match="asked to fail"):
            infer(client, data, fail=True)
    after = stats(client)
    assert after.fail == before.fail + 2  # the model failed it twice: nothing was stored
    assert (after.hits, after.misses) == (before.hits, before.misses)


def test_concurrent_identical_requests_get_one_answer_and_leave_one_entry(
    client: Any, server: RunningServer
) -> None:
    data = fresh(4, 8)
    entries = metrics(server)["nv_cache_num_entries"]
    before = stats(client)
    results = _all_at_once(client, data, 32)
    after = stats(client)
    counters = {int(r.as_numpy("OUTPUT1")[0]) for r in results}
    print("32 identical requests: executions", after.executions - before.executions,
          "hits", after.hits - before.hits, "misses", after.misses - before.misses)  # fmt: skip
    for result in results:
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data * 2)
    ran = after.executions - before.executions
    assert ran >= 1 and len(counters) == ran  # each answer is one execution's
    assert after.hits - before.hits + after.misses - before.misses == 32
    assert after.misses - before.misses == ran
    assert metrics(server)["nv_cache_num_entries"] == entries + 1


def _all_at_once(client: Any, data: np.ndarray, count: int) -> list[Any]:
    """``count`` identical requests in flight together (HTTP: tritonclient's async_infer,
    its client is not for threads; gRPC: threads)."""
    if isinstance(client, grpcclient.InferenceServerClient):
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(lambda _: infer(client, data), range(count)))
    tensor = httpclient.InferInput("INPUT0", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    pending = [client.async_infer("cached", [tensor]) for _ in range(count)]
    return [p.get_result() for p in pending]


# -- what is not cached ------------------------------------------------------------------
def test_a_model_without_response_cache_is_not_cached(client: Any, server: RunningServer) -> None:
    data = fresh(1, 3)
    before = stats(client, "uncached")
    infer(client, data, "uncached")
    infer(client, data, "uncached")
    after = stats(client, "uncached")
    assert after.executions == before.executions + 2
    assert (after.hits, after.misses) == (0, 0)
    assert model_metric("nv_cache_num_hits_per_model", "uncached") not in metrics(server)


def test_tensors_in_system_shared_memory_are_not_cached(client: Any) -> None:
    data = fresh(2, 2)
    key = f"/cache_test_{uuid.uuid4().hex}"
    region = shm.create_shared_memory_region("cache_region", key, 64)
    try:
        shm.set_shared_memory_region(region, [data])
        client.register_system_shared_memory("cache_region", key, 64)
        lib = _lib(client)
        before = stats(client)
        for _ in range(2):
            tensor = lib.InferInput("INPUT0", [2, 2], "FP32")
            tensor.set_shared_memory("cache_region", data.nbytes)
            result = client.infer("cached", [tensor])
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data * 2)
        for _ in range(2):  # an output into the region, the input in the request
            tensor = lib.InferInput("INPUT0", [2, 2], "FP32")
            tensor.set_data_from_numpy(data)
            output = lib.InferRequestedOutput("OUTPUT0")
            output.set_shared_memory("cache_region", data.nbytes, offset=32)
            client.infer("cached", [tensor], outputs=[output])
            got = shm.get_contents_as_numpy(region, np.float32, [2, 2], offset=32)
            np.testing.assert_array_equal(got, data * 2)
        after = stats(client)
        assert after.executions == before.executions + 4
        assert (after.hits, after.misses) == (before.hits, before.misses)
    finally:
        client.unregister_system_shared_memory("cache_region")
        shm.destroy_shared_memory_region(region)


@pytest.mark.gpu
@pytest.mark.skipif(cudashm is None or not cuda_ipc.available(), reason="no CUDA device")
def test_tensors_in_cuda_shared_memory_are_not_cached(client: Any) -> None:
    """As in Triton: CUDA inputs are not hashed, CUDA outputs not stored."""
    assert cudashm is not None
    data = fresh(2, 2)
    region = cudashm.create_shared_memory_region(f"cache_{uuid.uuid4().hex}", 64, 0)
    try:
        cudashm.set_shared_memory_region(region, [data])
        client.register_cuda_shared_memory("cache_cuda", cudashm.get_raw_handle(region), 0, 64)
        lib = _lib(client)
        before = stats(client)
        for _ in range(2):
            tensor = lib.InferInput("INPUT0", [2, 2], "FP32")
            tensor.set_shared_memory("cache_cuda", data.nbytes)
            result = client.infer("cached", [tensor], outputs=[lib.InferRequestedOutput("OUTPUT0")])
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data * 2)
        for _ in range(2):
            tensor = lib.InferInput("INPUT0", [2, 2], "FP32")
            tensor.set_data_from_numpy(data)
            output = lib.InferRequestedOutput("OUTPUT0")
            output.set_shared_memory("cache_cuda", data.nbytes, offset=32)
            client.infer("cached", [tensor], outputs=[output])
            got = cudashm.get_contents_as_numpy(region, np.float32, [8, 2])[4:6]  # at 32
            np.testing.assert_array_equal(got, data * 2)
        after = stats(client)
        assert after.executions == before.executions + 4
        assert (after.hits, after.misses) == (before.hits, before.misses)
    finally:
        client.unregister_cuda_shared_memory("cache_cuda")
        cudashm.destroy_shared_memory_region(region)


def test_a_top_level_ensemble_request_is_cached(client: Any) -> None:
    data = fresh(2, 5)
    step = stats(client, "uncached")
    first = infer(client, data, "cached_ensemble")
    before = stats(client, "cached_ensemble")
    second = infer(client, data, "cached_ensemble")
    after = stats(client, "cached_ensemble")
    np.testing.assert_array_equal(second.as_numpy("OUT"), data * 2)
    assert second.as_numpy("COUNT")[0] == first.as_numpy("COUNT")[0]
    assert stats(client, "uncached").executions == step.executions + 1
    assert (after.hits - before.hits, after.success - before.success) == (1, 1)


def test_an_ensemble_step_whose_model_has_the_cache_can_be_a_hit(client: Any) -> None:
    data = fresh(2, 2)
    before = stats(client), stats(client, "uncached"), stats(client, "steps_ensemble")
    first = infer(client, data, "steps_ensemble")
    second = infer(client, data, "steps_ensemble")
    after = stats(client), stats(client, "uncached"), stats(client, "steps_ensemble")
    np.testing.assert_array_equal(second.as_numpy("OUT"), data * 4)
    assert second.as_numpy("COUNT")[0] == first.as_numpy("COUNT")[0]
    assert after[1].executions == before[1].executions + 2  # the first step ran twice
    assert after[0].executions == before[0].executions + 1  # the cached one once ...
    assert (after[0].hits - before[0].hits, after[0].misses - before[0].misses) == (1, 1)
    assert after[2].success == before[2].success + 2 and after[2].hits == 0  # ... not the ensemble


# -- reloads, metrics --------------------------------------------------------------------
def test_a_reloaded_model_does_not_answer_with_its_predecessors_responses(
    server: RunningServer,
) -> None:
    data = fresh(1, 3)
    source = (CACHE_MODELS / "cached" / "1" / "model.py").read_text()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        np.testing.assert_array_equal(infer(client, data).as_numpy("OUTPUT0"), data * 2)
        config = json.dumps(client.get_model_config("cached", as_json=True)["config"])
        tripled = source.replace("FACTOR = 2", "FACTOR = 3").encode()
        client.load_model("cached", config=config, files={"file:1/model.py": tripled})
        np.testing.assert_array_equal(infer(client, data).as_numpy("OUTPUT0"), data * 3)
        assert metrics(server)["nv_cache_num_entries"] == 1 + _others(server)
        client.unload_model("cached")
        assert metrics(server)["nv_cache_num_entries"] == _others(server)
        client.load_model("cached")  # from the repository again: FACTOR = 2
        np.testing.assert_array_equal(infer(client, data).as_numpy("OUTPUT0"), data * 2)
        assert (stats(client).executions, stats(client).hits) == (1, 0)


def _others(server: RunningServer) -> int:
    """Entries of the ensemble (the only other cached model here)."""
    return int(metrics(server)[model_metric("nv_cache_num_misses_per_model", "cached_ensemble")])


def test_metrics_agree_with_the_statistics(client: Any, server: RunningServer) -> None:
    data = fresh(3, 3)
    infer(client, data)
    infer(client, data)
    s, got = stats(client), metrics(server)
    print({k: v for k, v in got.items() if k.startswith("nv_cache")})
    assert got[model_metric("nv_cache_num_hits_per_model")] == s.hits >= 1
    assert got[model_metric("nv_cache_num_misses_per_model")] == s.misses >= 1
    assert got[model_metric("nv_cache_hit_duration_per_model")] == s.hit_ns // 1000
    assert got[model_metric("nv_cache_miss_duration_per_model")] == s.miss_ns // 1000
    assert got["nv_cache_num_lookups"] == got["nv_cache_num_hits"] + got["nv_cache_num_misses"]
    assert got["nv_cache_num_hits"] >= s.hits and 0 < got["nv_cache_util"] < 1
    assert got[model_metric("nv_inference_request_success")] == s.success


# -- a small cache: eviction and accounting ----------------------------------------------
def _entry_size(columns: int) -> int:
    """What a response of the model to a [1, columns] input costs in the cache."""
    out0 = CachedTensor("OUTPUT0", "FP32", (1, columns), bytes(4 * columns))
    out1 = CachedTensor("OUTPUT1", "INT64", (1,), bytes(8))
    return packed_size((out0, out1), {})


def test_least_recently_used_responses_are_evicted_at_the_configured_size(
    tmp_path: Path,
) -> None:
    size = _entry_size(16)
    capacity = 2 * size + size // 2  # two entries fit, three do not
    repository = _repository(tmp_path, "cached")
    with (
        run_server(repository, "--cache-config", f"local,size={capacity}") as running,
        grpcclient.InferenceServerClient(running.grpc_url) as client,
    ):
        a, b, c = fresh(1, 16), fresh(1, 16), fresh(1, 16)
        for data in (a, b, a, c, a, b, c):  # c evicts b, b evicts c, c evicts a
            infer(client, data)
        s, got = stats(client), metrics(running)
        print("LRU:", s, {k: v for k, v in got.items() if k.startswith("nv_cache")})
        assert (s.executions, s.hits, s.misses) == (5, 2, 5)
        assert got["nv_cache_num_evictions"] == 3 and got["nv_cache_num_entries"] == 2
        assert round(got["nv_cache_util"] * capacity) == 2 * size  # exact accounting
        big = fresh(1, 2 * capacity // 4)  # its response alone is larger than the cache
        infer(client, big)
        infer(client, big)
        after, got = stats(client), metrics(running)
        assert (after.executions, after.misses) == (s.executions + 2, s.misses + 2)
        assert got["nv_cache_num_evictions"] == 3 and got["nv_cache_num_entries"] == 2


# -- no cache, refused models, bad options -----------------------------------------------
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_without_a_server_cache_the_model_runs_uncached_and_what_triton_refuses_fails(
    tmp_path: Path, protocol: str
) -> None:
    repository = _repository(tmp_path, "cached", "cached_decoupled", "cached_sequence",
                             "cached_over_sequence")  # fmt: skip
    repository_of(repository, TEST_MODELS / "sequence_acc")
    with run_server(repository, "--model-control-mode", "explicit", "--load-model",
                    "cached") as running:  # fmt: skip
        for client in _client(protocol, running):
            data = fresh(1, 2)
            infer(client, data)
            infer(client, data)
            s = stats(client)
            assert (s.executions, s.hits, s.misses) == (2, 0, 0)
            assert not any(k.startswith("nv_cache") for k in metrics(running))
            refusals = {
                "cached_decoupled": "Response Cache does not currently support model "
                "cached_decoupled with 'decoupled' transaction policy. Please disable the "
                "response cache.",
                "cached_sequence": "Response Cache does not currently support model "
                "cached_sequence with sequence batching scheduler. Please disable the response "
                "cache.",
                "cached_over_sequence": "Response Cache does not currently support ensemble "
                "cached_over_sequence: its step model 'sequence_acc' uses the sequence "
                "batching scheduler",
            }
            for model, message in refusals.items():
                with pytest.raises(InferenceServerException) as refused:
                    client.load_model(model)
                assert message in refused.value.message(), model


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--cache-config", "redis,host=localhost"], "cache 'redis' is not available"),
        (["--cache-config", "local,size=lots"], "must be a number of bytes, got 'lots'"),
        (["--cache-config", "local,size=0"], "at least 1 byte"),
        (["--cache-config", "size=10"], "No cache specified"),
        (["--response-cache-byte-size", "10", "--cache-config", "local,size=10"],
         "Incompatible flags"),
    ],
)  # fmt: skip
def test_a_bad_cache_config_is_refused_at_start(
    tmp_path: Path, options: list[str], message: str
) -> None:
    command = [sys.executable, "-m", "dlserve", "serve", "--model-repository", str(tmp_path),
               "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", *options]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
