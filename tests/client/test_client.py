"""dlserve.client against a real server (CPU): one-call inference with numpy and torch over
gRPC, HTTP and gRPC on a Unix socket; 8 threads and 4 processes at once; the pool reused
(the server's region count flat over 1,000 calls); cleanup on exception, on close, at
interpreter exit and after SIGKILL (the server reclaims; the next client sweeps the object).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import EXAMPLES, TEST_MODELS, RunningServer, run_server
from dlserve.client import AsyncClient, Client

PROCESS = Path(__file__).with_name("sdk_process.py")
RNG = np.random.default_rng(5)
BIG = 50_000  # FP32 elements: 200 KB, above the 64 KiB threshold, through shared memory
DEADLINE_S = 5.0


@pytest.fixture(scope="module")
def uds_dir() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="dlc")  # short: a socket path has 108 bytes at most
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, uds_dir: str) -> Iterator[RunningServer]:
    repository = tmp_path_factory.mktemp("sdk_repo")
    for model in ("add_sub", "identity_bytes", "identity_bf16", "identity_int64", "double"):
        shutil.copytree(EXAMPLES / model, repository / model)
    shutil.copytree(TEST_MODELS / "in_place", repository / "in_place")
    with run_server(repository, "--grpc-uds", f"{uds_dir}/grpc.sock") as running:
        yield running


def urls(server: RunningServer, uds_dir: str) -> dict[str, str]:
    return {
        "grpc": server.grpc_url,
        "http": f"http://{server.http_url}",
        "uds": f"unix://{uds_dir}/grpc.sock",
    }


@pytest.fixture(params=["grpc", "http", "uds"])
def url(request: pytest.FixtureRequest, server: RunningServer, uds_dir: str) -> str:
    return urls(server, uds_dir)[request.param]


def status(server: RunningServer) -> set[str]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        return set(client.get_system_shared_memory_status().regions)
    finally:
        client.close()


def wait_until(done: Callable[[], bool], deadline_s: float = DEADLINE_S) -> float:
    start = time.monotonic()
    while not done():
        assert time.monotonic() - start < deadline_s, f"not done within {deadline_s} s"
        time.sleep(0.02)  # polling an observable that has no event
    return time.monotonic() - start


def reclaimed(server: RunningServer) -> float:
    text = urllib.request.urlopen(server.metrics_url).read().decode()
    found = re.search(
        r'^dlserve_shm_regions_reclaimed_total{reason="owner_exit"} (\S+)$', text, re.M
    )
    assert found
    return float(found.group(1))


def fp32(n: int = BIG) -> Any:
    return RNG.standard_normal(n).astype(np.float32)


def objects_of(names: list[str]) -> list[str]:
    return [name for name in names if Path(f"/dev/shm/{name}").exists()]


# -- one call ---------------------------------------------------------------------------
def test_numpy_and_torch_inputs(url: str, server: RunningServer) -> None:
    torch = pytest.importorskip("torch")
    a, b = fp32(), fp32()
    with Client(url) as client:
        out = client.infer("add_sub", {"INPUT0": a, "INPUT1": torch.from_numpy(b)})
        assert isinstance(out["OUTPUT0"], np.ndarray)
        np.testing.assert_array_equal(out["OUTPUT0"], a + b)
        np.testing.assert_array_equal(out["OUTPUT1"], a - b)
        assert client.registered_regions() == 1  # both inputs in one region
        assert len(status(server)) == 1
        small = client.infer("add_sub", {"INPUT0": a[:4], "INPUT1": b[:4]}, ["OUTPUT1"])
        assert list(small) == ["OUTPUT1"]  # only what was asked for
        np.testing.assert_array_equal(torch.from_dlpack(small["OUTPUT1"]).numpy(), a[:4] - b[:4])
        strided = client.infer("add_sub", {"INPUT0": a[::2], "INPUT1": b[::2]})
        np.testing.assert_array_equal(strided["OUTPUT0"], a[::2] + b[::2])
    assert status(server) == set()


def test_other_data_types(url: str) -> None:
    torch = pytest.importorskip("torch")
    with Client(url) as client:
        strings = np.array([b"a", b"\x00bc", b""] * 30_000, dtype=object)  # big: via a region
        out = client.infer("identity_bytes", {"INPUT0": strings})
        assert out["OUTPUT0"].tolist() == strings.tolist()
        ints = torch.arange(20_000, dtype=torch.int64)
        out = client.infer("identity_int64", {"INPUT0": ints})
        np.testing.assert_array_equal(out["OUTPUT0"], ints.numpy())
        bf16 = torch.randn(8, dtype=torch.bfloat16)
        out = client.infer("identity_bf16", {"INPUT0": bf16})
        np.testing.assert_array_equal(out["OUTPUT0"].astype(np.float32), bf16.float().numpy())


def test_errors_give_the_region_back(url: str, server: RunningServer) -> None:
    with Client(url) as client:
        a = fp32()
        with pytest.raises(InferenceServerException, match="unknown model"):
            client.infer("no_such_model", {"INPUT0": a, "INPUT1": a})
        with pytest.raises(InferenceServerException):
            client.infer("add_sub", {"INPUT0": a, "INPUT1": a[:5]})  # shapes differ
        client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
        assert client.registered_regions() == 1  # the failed calls' region, reused
        with pytest.raises(ValueError, match="has no Triton data type"):
            client.infer("add_sub", {"INPUT0": np.array([1j]), "INPUT1": a})


def test_fixed_size_outputs_are_written_into_the_region(url: str, server: RunningServer) -> None:
    """double's OUTPUT_0 has a fixed size (588 KiB): named, or not named (every output), it
    is written into the call's region beside the input, which is therefore 2 MiB rather
    than 1 MiB; add_sub's outputs have no fixed size and come back in the response."""
    image = RNG.standard_normal((1, 3, 224, 224)).astype(np.float32)
    for outputs in (["OUTPUT_0"], None):
        with Client(url) as client:
            for _ in range(3):
                out = client.infer("double", {"INPUT_0": image}, outputs)
                assert list(out) == ["OUTPUT_0"]
                np.testing.assert_array_equal(out["OUTPUT_0"], image * 2)
            sizes = [slot.size for pool in client._pools.all() for slot in pool._all]
            assert sizes == [2 << 20]
    with Client(url) as client:
        a = fp32(300_000)  # 1.2 MB each: both inputs in one 4 MiB region, no room for outputs
        out = client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
        np.testing.assert_array_equal(out["OUTPUT0"], a + a)
        sizes = [slot.size for pool in client._pools.all() for slot in pool._all]
        assert sizes == [4 << 20]
    assert status(server) == set()


def test_in_place_writes_do_not_reach_the_callers_tensor(url: str) -> None:
    """The model writes into its input, which is the SDK's region, not the caller's array."""
    x = np.zeros(4, dtype=np.float32)
    with Client(url, shm_threshold=0) as client:  # even 16 bytes through a region
        out = client.infer("in_place", {"INPUT0": x})
        assert out["SAME_MEMORY"].tolist() == [True]  # the model did write in place
        np.testing.assert_array_equal(out["OUTPUT0"], x + 1)
        assert client.registered_regions() == 1
    np.testing.assert_array_equal(x, 0)


def test_remote_looking_server_gets_bytes_in_the_request(server: RunningServer) -> None:
    with Client(server.grpc_url, shared_memory=False) as client:
        a = fp32()
        out = client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
        np.testing.assert_array_equal(out["OUTPUT0"], 2 * a)
        assert client.registered_regions() == 0
    assert status(server) == set()


# -- concurrency ------------------------------------------------------------------------
def test_eight_threads_share_one_client(url: str, server: RunningServer) -> None:
    errors: list[BaseException] = []
    seen: set[str] = set()
    with Client(url) as client:

        def work(seed: int) -> None:
            rng = np.random.default_rng(seed)
            try:
                for _ in range(25):
                    a = rng.standard_normal(BIG).astype(np.float32)
                    b = rng.standard_normal(BIG).astype(np.float32)
                    out = client.infer("add_sub", {"INPUT0": a, "INPUT1": b})
                    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
                    np.testing.assert_array_equal(out["OUTPUT1"], a - b)
                    seen.update(status(server))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert 1 <= client.registered_regions() <= 8  # at most one region per call in flight
        print(f"8 threads x 25 calls: {client.registered_regions()} regions, {len(seen)} seen")
    assert status(server) == set()


def test_four_processes_at_once(url: str, server: RunningServer) -> None:
    processes = [
        subprocess.Popen([sys.executable, str(PROCESS), url, "loop", "50"], stdout=subprocess.PIPE)
        for _ in range(4)
    ]
    reports = []
    for process in processes:
        with process:
            out, _ = process.communicate(timeout=120)
            assert process.returncode == 0
            reports.append(json.loads(out))
    assert [report["ok"] for report in reports] == [50] * 4  # no wrong result
    names = [name for report in reports for name in report["regions"]]
    assert len(names) == len(set(names)) == 4  # one region each, no name shared
    assert all(str(report["pid"]) in name for report in reports for name in report["regions"])
    assert status(server) == set()


def test_the_pool_is_reused_over_1000_calls(server: RunningServer) -> None:
    counts = []
    a, b = fp32(), fp32()
    with Client(server.grpc_url) as client:
        for call in range(1000):
            out = client.infer("add_sub", {"INPUT0": a, "INPUT1": b})
            if call % 100 == 0:
                counts.append(len(status(server)))
        np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    print(f"registered regions every 100 calls: {counts}")
    assert counts == [1] * 10


def test_async_client(server: RunningServer, uds_dir: str) -> None:
    async def main(url: str) -> int:
        async with AsyncClient(url) as client:
            pairs = [(fp32(), fp32()) for _ in range(8)]
            outs = await asyncio.gather(
                *(client.infer("add_sub", {"INPUT0": a, "INPUT1": b}) for a, b in pairs)
            )
            for (a, b), out in zip(pairs, outs, strict=True):
                np.testing.assert_array_equal(out["OUTPUT0"], a + b)
            return client.registered_regions()

    for url in urls(server, uds_dir).values():
        assert 1 <= asyncio.run(main(url)) <= 8
        assert status(server) == set()


# -- cleanup ----------------------------------------------------------------------------
def test_cleanup_on_an_exception(server: RunningServer) -> None:
    names: list[str] = []
    with pytest.raises(RuntimeError, match="boom"), Client(server.grpc_url) as client:
        client.infer("add_sub", {"INPUT0": fp32(), "INPUT1": fp32()})
        names = [slot.name for pool in client._pools.all() for slot in pool._all]
        assert set(names) <= status(server) and objects_of(names) == names
        raise RuntimeError("boom")
    assert status(server) == set()
    assert objects_of(names) == []


def test_cleanup_at_interpreter_exit(server: RunningServer) -> None:
    """No close(): the SDK's exit hook unregisters (the server reclaims nothing) and unlinks."""
    before = reclaimed(server)
    with subprocess.Popen(
        [sys.executable, str(PROCESS), server.grpc_url, "exit"], stdout=subprocess.PIPE
    ) as process:
        report = json.loads(process.communicate(timeout=60)[0])
    assert process.returncode == 0 and report["ok"] == 1
    assert status(server) == set()
    assert objects_of(report["regions"]) == []
    assert reclaimed(server) == before  # the client cleaned up, not the server


def test_a_killed_client_is_cleaned_up(server: RunningServer) -> None:
    with subprocess.Popen(
        [sys.executable, str(PROCESS), server.grpc_url, "hang"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    ) as process:  # fmt: skip
        assert process.stdout is not None
        report = json.loads(process.stdout.readline())
        assert set(report["regions"]) <= status(server)
        process.send_signal(signal.SIGKILL)
        process.wait()
    took = wait_until(lambda: not set(report["regions"]) & status(server))
    print(f"regions of the killed client gone from status {took:.3f} s after SIGKILL")
    assert objects_of(report["regions"]) == report["regions"]  # its object is left ...
    with contextlib.closing(Client(server.grpc_url)):
        assert objects_of(report["regions"]) == []  # ... until the next client sweeps it


def test_a_server_that_refuses_shared_memory_gets_the_tensors_in_the_requests(
    tmp_path: Path,
) -> None:
    shutil.copytree(EXAMPLES / "add_sub", tmp_path / "add_sub")
    a = fp32()
    with run_server(tmp_path, "--allow-client-shm", "false") as server:
        for url in (server.grpc_url, f"http://{server.http_url}"):
            with Client(url) as client:
                for _ in range(2):  # refused once, then not asked again
                    out = client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
                    np.testing.assert_array_equal(out["OUTPUT0"], 2 * a)
                assert client.registered_regions() == 0

        async def main() -> None:
            async with AsyncClient(server.grpc_url) as client:
                out = await client.infer("add_sub", {"INPUT0": a, "INPUT1": a}, ["OUTPUT1"])
                np.testing.assert_array_equal(out["OUTPUT1"], 0 * a)

        asyncio.run(main())
