"""Ensembles through a real server and tritonclient, over gRPC and HTTP.

- examples/models/ensemble_add_sub (three add_sub steps, two of them side by side) gives
  the right outputs, small and large (the large ones pass between steps through the
  workers' arenas), and a subset of them when asked;
- its metadata, config and statistics are its own; each step counts in add_sub's;
- it is READY only while its steps are: unloading add_sub makes it UNAVAILABLE;
- inputs from and outputs into system shared memory work through the steps;
- an ensemble whose step is missing, or failed to load, is UNAVAILABLE with the reason.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from conftest import EXAMPLES, TEST_MODELS, RunningServer, repository_of, run_server
from dlserve.tensors import cuda_ipc

ENSEMBLE = "ensemble_add_sub"
RNG = np.random.default_rng(6)


@dataclass
class Client:
    protocol: str
    lib: Any
    api: Any

    def infer(self, model: str, a: Any, b: Any, outputs: list[str] | None = None) -> Any:
        inputs = []
        for name, array in (("INPUT0", a), ("INPUT1", b)):
            tensor = self.lib.InferInput(name, list(array.shape), "FP32")
            if self.protocol == "http":
                tensor.set_data_from_numpy(array, binary_data=True)
            else:
                tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        wanted = [self.lib.InferRequestedOutput(n) for n in outputs] if outputs else None
        return self.api.infer(model, inputs, outputs=wanted)

    def stats(self, model: str) -> dict[str, Any]:
        if self.protocol == "grpc":
            found = self.api.get_inference_statistics(model, as_json=True)
        else:
            found = self.api.get_inference_statistics(model)
        result: dict[str, Any] = found["model_stats"][0]
        return result

    def metadata(self, model: str) -> dict[str, Any]:
        if self.protocol == "grpc":
            found: dict[str, Any] = self.api.get_model_metadata(model, as_json=True)
            return found
        result: dict[str, Any] = self.api.get_model_metadata(model)
        return result

    def config(self, model: str) -> dict[str, Any]:
        if self.protocol == "grpc":
            found: dict[str, Any] = self.api.get_model_config(model, as_json=True)["config"]
            return found
        result: dict[str, Any] = self.api.get_model_config(model)
        return result

    def reason(self, model: str) -> tuple[str, str]:
        if self.protocol == "grpc":
            rows = self.api.get_model_repository_index(as_json=True).get("models", [])
        else:
            rows = self.api.get_model_repository_index()
        [row] = [r for r in rows if r["name"] == model]
        return row.get("state", ""), row.get("reason", "")


def _connect(protocol: str, server: RunningServer) -> Client:
    if protocol == "grpc":
        return Client("grpc", grpcclient, grpcclient.InferenceServerClient(server.grpc_url))
    return Client("http", httpclient, httpclient.InferenceServerClient(server.http_url))


@pytest.fixture(scope="module", params=["grpc", "http"])
def examples(request: pytest.FixtureRequest, example_server: RunningServer) -> Iterator[Client]:
    connected = _connect(request.param, example_server)
    yield connected
    connected.api.close()


@pytest.fixture(scope="module", params=["grpc", "http"])
def tests(request: pytest.FixtureRequest, test_server: RunningServer) -> Iterator[Client]:
    connected = _connect(request.param, test_server)
    yield connected
    connected.api.close()


def _count(stat: dict[str, Any], key: str) -> int:
    return int(stat.get(key, 0))


@pytest.mark.parametrize("size", [4, 300_000])  # 1.2 MB: through the arenas
def test_the_ensemble_computes_its_steps_in_order(examples: Client, size: int) -> None:
    a = RNG.standard_normal(size).astype(np.float32)
    b = RNG.standard_normal(size).astype(np.float32)
    before = examples.stats(ENSEMBLE), examples.stats("add_sub")
    result = examples.infer(ENSEMBLE, a, b)
    np.testing.assert_allclose(result.as_numpy("OUTPUT0"), 2 * a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result.as_numpy("OUTPUT1"), 2 * b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result.as_numpy("OUTPUT2"), -2 * b, rtol=1e-5, atol=1e-5)
    after = examples.stats(ENSEMBLE), examples.stats("add_sub")
    print(f"{examples.protocol} ensemble statistics:", after[0])
    assert _count(after[0], "inference_count") == _count(before[0], "inference_count") + 1
    assert _count(after[0], "execution_count") == _count(before[0], "execution_count") + 1
    assert _count(after[1], "execution_count") == _count(before[1], "execution_count") + 3


def test_only_the_outputs_asked_for_come_back(examples: Client) -> None:
    a, b = np.array([1, 2], np.float32), np.array([5, 7], np.float32)
    result = examples.infer(ENSEMBLE, a, b, outputs=["OUTPUT2"])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT2"), -2 * b)
    assert result.as_numpy("OUTPUT0") is None


def test_the_ensemble_has_its_own_metadata_and_config(examples: Client) -> None:
    metadata = examples.metadata(ENSEMBLE)
    print(f"{examples.protocol} metadata:", metadata)
    assert metadata["platform"] == "ensemble"
    assert [i["name"] for i in metadata["inputs"]] == ["INPUT0", "INPUT1"]
    assert [o["name"] for o in metadata["outputs"]] == ["OUTPUT0", "OUTPUT1", "OUTPUT2"]
    config = examples.config(ENSEMBLE)
    steps = config["ensemble_scheduling"]["step"]
    assert [s["model_name"] for s in steps] == ["add_sub"] * 3
    assert examples.api.is_model_ready(ENSEMBLE)


def test_a_bad_input_is_refused_by_the_ensemble(examples: Client) -> None:
    tensor = examples.lib.InferInput("INPUT0", [2], "INT32")
    tensor.set_data_from_numpy(np.array([1, 2], np.int32))
    with pytest.raises(InferenceServerException) as info:
        examples.api.infer(ENSEMBLE, [tensor])
    assert "ensemble_add_sub" in info.value.message()


def test_an_ensemble_with_a_missing_step_is_unavailable_with_the_reason(tests: Client) -> None:
    state, reason = tests.reason("ensemble_missing_step")
    print("missing step:", state, reason)
    assert state == "UNAVAILABLE"
    assert reason == (
        "ensemble ensemble_missing_step contains models that are not available or "
        "ambiguous: no_such_model"
    )
    a = np.ones(2, np.float32)
    tensor = tests.lib.InferInput("INPUT0", [2], "FP32")
    tensor.set_data_from_numpy(a)
    with pytest.raises(InferenceServerException) as info:
        tests.api.infer("ensemble_missing_step", [tensor])
    expected = "StatusCode.UNAVAILABLE" if tests.protocol == "grpc" else "503"
    print(info.value.status(), info.value.message())
    assert str(info.value.status()) == expected
    assert "ensemble_missing_step" in info.value.message()


def test_an_ensemble_whose_step_failed_to_load_says_why(tests: Client) -> None:
    state, reason = tests.reason("ensemble_failed_step")
    print("failed step:", state, reason)
    assert state == "UNAVAILABLE"
    assert reason.startswith(
        "ensemble 'ensemble_failed_step' depends on 'init_raises' which has no loaded "
        "version. Model 'init_raises' loading failed with error: "
    )
    assert "initialize failed on purpose" in reason


# -- readiness follows the steps ---------------------------------------------------------
@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repository = tmp_path_factory.mktemp("ensemble_repo")
    for name in ("add_sub", ENSEMBLE):
        shutil.copytree(EXAMPLES / name, repository / name)
    with run_server(repository, "--model-control-mode", "explicit") as server:
        yield server


def test_the_ensemble_is_ready_only_while_its_steps_are(explicit_server: RunningServer) -> None:
    client = _connect("grpc", explicit_server)
    a, b = np.array([1], np.float32), np.array([2], np.float32)
    client.api.load_model(ENSEMBLE)  # loads add_sub too, as Triton does
    assert client.api.is_model_ready("add_sub")
    assert client.api.is_model_ready(ENSEMBLE)
    client.api.unload_model("add_sub")
    assert not client.api.is_model_ready(ENSEMBLE)
    with pytest.raises(InferenceServerException) as info:
        client.infer(ENSEMBLE, a, b)
    print("steps unloaded:", info.value.status(), info.value.message())
    assert str(info.value.status()) == "StatusCode.UNAVAILABLE"
    client.api.load_model("add_sub")
    assert client.api.is_model_ready(ENSEMBLE)
    np.testing.assert_array_equal(client.infer(ENSEMBLE, a, b).as_numpy("OUTPUT0"), 2 * a)
    client.api.close()


def test_shared_memory_inputs_and_outputs(example_server: RunningServer) -> None:
    """Inputs read from a client's region by the first step; OUTPUT1 written into a
    region by the step that produces it; OUTPUT0 in the response."""
    size = 1000
    a = RNG.standard_normal(size).astype(np.float32)
    b = RNG.standard_normal(size).astype(np.float32)
    key = f"/ensemble_test_{uuid.uuid4().hex}"
    handle = shm.create_shared_memory_region("ens", key, 3 * a.nbytes)
    client = grpcclient.InferenceServerClient(example_server.grpc_url)
    try:
        shm.set_shared_memory_region(handle, [a, b])
        client.register_system_shared_memory("ens", key, 3 * a.nbytes)
        inputs = []
        for index, name in enumerate(("INPUT0", "INPUT1")):
            tensor = grpcclient.InferInput(name, [size], "FP32")
            tensor.set_shared_memory("ens", a.nbytes, offset=index * a.nbytes)
            inputs.append(tensor)
        into_region = grpcclient.InferRequestedOutput("OUTPUT1")
        into_region.set_shared_memory("ens", a.nbytes, offset=2 * a.nbytes)
        outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), into_region]
        result = client.infer(ENSEMBLE, inputs, outputs=outputs)
        np.testing.assert_allclose(result.as_numpy("OUTPUT0"), 2 * a, rtol=1e-5, atol=1e-5)
        written = shm.get_contents_as_numpy(handle, np.float32, [size], offset=2 * a.nbytes)
        np.testing.assert_allclose(written, 2 * b, rtol=1e-5, atol=1e-5)
    finally:
        client.unregister_system_shared_memory("ens")
        client.close()
        shm.destroy_shared_memory_region(handle)


GPU_PIPELINE = """
platform: "ensemble"
max_batch_size: 0
input [ { name: "INPUT_0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT_0" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "gpu_ops" input_map { key: "INPUT_0" value: "INPUT_0" }
      output_map { key: "OUTPUT_0" value: "TWICE" } },
    { model_name: "gpu_ops" input_map { key: "INPUT_0" value: "TWICE" }
      output_map { key: "OUTPUT_0" value: "OUTPUT_0" } }
  ]
}
"""


@pytest.mark.gpu
def test_cuda_shared_memory_through_an_ensemble_of_gpu_models(tmp_path: Path) -> None:
    """The first step reads the client's CUDA region in place; the last step writes its
    output into the client's CUDA region (x * 2 * 2)."""
    if not cuda_ipc.available():
        pytest.skip("no CUDA device")
    import tritonclient.utils.cuda_shared_memory as cudashm

    shutil.copytree(TEST_MODELS / "gpu_ops", tmp_path / "gpu_ops")
    (tmp_path / "gpu_pipeline" / "1").mkdir(parents=True)
    (tmp_path / "gpu_pipeline" / "config.pbtxt").write_text(GPU_PIPELINE)
    data = RNG.standard_normal(4096).astype(np.float32)
    with run_server(tmp_path) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        handles = [cudashm.create_shared_memory_region(n, data.nbytes, 0) for n in ("i", "o")]
        try:
            cudashm.set_shared_memory_region(handles[0], [data])
            for name, handle in zip(("in", "out"), handles, strict=True):
                raw = cudashm.get_raw_handle(handle)
                client.register_cuda_shared_memory(name, raw, 0, data.nbytes)
            tensor = grpcclient.InferInput("INPUT_0", [data.size], "FP32")
            tensor.set_shared_memory("in", data.nbytes)
            output = grpcclient.InferRequestedOutput("OUTPUT_0")
            output.set_shared_memory("out", data.nbytes)
            client.infer("gpu_pipeline", [tensor], outputs=[output])
            result = cudashm.get_contents_as_numpy(handles[1], np.float32, [data.size])
            np.testing.assert_allclose(result, data * 4, rtol=1e-6)
        finally:
            client.unregister_cuda_shared_memory()
            client.close()
            for handle in handles:
                cudashm.destroy_shared_memory_region(handle)


BY_REFERENCE = """
name: "by_reference"
platform: "ensemble"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
ensemble_scheduling {
  step [
    { model_name: "double" model_version: -1
      input_map { key: "INPUT0" value: "X" } output_map { key: "OUTPUT0" value: "T1" } },
    { model_name: "in_place" model_version: -1
      input_map { key: "INPUT0" value: "T1" }
      output_map { key: "OUTPUT0" value: "T2" } output_map { key: "SAME_MEMORY" value: "S" } },
    { model_name: "add_sub" model_version: -1
      input_map { key: "INPUT0" value: "T1" } input_map { key: "INPUT1" value: "T2" }
      output_map { key: "OUTPUT0" value: "OUT" } }
  ]
}
"""


def test_intermediate_tensors_pass_by_reference(tmp_path: Path) -> None:
    """T1 = 2x (400 KB, in double's output arena); in_place adds 1 to T1 where it lies;
    add_sub then reads T1 again, after in_place (it also needs T2): with T1 passed by
    reference it reads 2x + 1 and OUT = (2x + 1) + (2x + 1); with a copy per hop it
    would read 2x and OUT would be 4x + 1."""
    repository = repository_of(tmp_path, TEST_MODELS / "double", TEST_MODELS / "in_place",
                               EXAMPLES / "add_sub")  # fmt: skip
    (repository / "by_reference" / "1").mkdir(parents=True)
    (repository / "by_reference" / "config.pbtxt").write_text(BY_REFERENCE)
    x = RNG.integers(0, 1000, 100_000).astype(np.float32)
    with run_server(repository) as server:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        for _ in range(3):  # and again: what was lent went back
            tensor = grpcclient.InferInput("X", [x.size], "FP32")
            tensor.set_data_from_numpy(x)
            result = client.infer("by_reference", [tensor])
            np.testing.assert_array_equal(result.as_numpy("OUT"), 4 * x + 2)
        client.close()
