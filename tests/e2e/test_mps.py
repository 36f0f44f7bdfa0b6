"""``--mps``: a private NVIDIA MPS daemon whose clients are the workers.

Without the daemon's program (CI), the server refuses to start and says why. On a GPU:
a request through CUDA shared memory from a client outside MPS is answered right, every
worker is a client of the daemon's MPS server, and after shutdown the daemon and its
folder are gone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient

from conftest import EXAMPLES, repository_of, run_server
from dlserve.server.core.host.mps import CONTROL
from dlserve.tensors import cuda_ipc

try:
    import tritonclient.utils.cuda_shared_memory as cudashm
except (ImportError, RuntimeError):  # needs cuda-python
    cudashm = None

HAS_GPU = cudashm is not None and cuda_ipc.available()
SHAPE = [1, 3, 224, 224]


def test_without_the_mps_program_the_server_refuses_to_start(tmp_path: Path) -> None:
    repository = repository_of(tmp_path / "repo", EXAMPLES / "add_sub")
    command = [sys.executable, "-m", "dlserve", "serve", "--model-repository", str(repository),
               "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--mps"]  # fmt: skip
    result = subprocess.run(command, env={**os.environ, "PATH": str(tmp_path)},
                            capture_output=True, timeout=120, check=False)  # fmt: skip
    assert result.returncode == 1
    assert f"--mps: {CONTROL} is not on PATH" in result.stderr.decode()


def _control(env: dict[str, str], command: str) -> list[int]:
    result = subprocess.run([CONTROL], input=command.encode() + b"\n", capture_output=True,
                            env={**os.environ, **env}, timeout=30, check=True)  # fmt: skip
    return [int(word) for word in result.stdout.split()]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
def test_the_workers_are_clients_of_the_servers_own_mps_daemon(tmp_path: Path) -> None:
    repository = repository_of(tmp_path / "repo", EXAMPLES / "double")
    nbytes = int(np.prod(SHAPE)) * 4
    regions = [cudashm.create_shared_memory_region(f"mps_{n}", nbytes, 0) for n in "io"]
    try:
        with run_server(repository, "--mps") as server:
            client = grpcclient.InferenceServerClient(server.grpc_url)
            for name, region in zip("io", regions, strict=True):
                raw = cudashm.get_raw_handle(region)
                client.register_cuda_shared_memory(f"mps_{name}", raw, 0, nbytes)
            data = np.random.default_rng(3).standard_normal(SHAPE).astype(np.float32)
            cudashm.set_shared_memory_region(regions[0], [data])
            tensor = grpcclient.InferInput("INPUT_0", SHAPE, "FP32")
            tensor.set_shared_memory("mps_i", nbytes)
            output = grpcclient.InferRequestedOutput("OUTPUT_0")
            output.set_shared_memory("mps_o", nbytes)
            client.infer("double", [tensor], outputs=[output])
            got = cudashm.get_contents_as_numpy(regions[1], np.float32, SHAPE)
            np.testing.assert_array_equal(got, data * 2)
            client.unregister_cuda_shared_memory()
            client.close()

            children = psutil.Process(server.process.pid).children(recursive=True)
            (daemon,) = [c for c in children if c.name() == CONTROL]
            workers = [c.pid for c in children if "dlserve.worker.main" in c.cmdline()]
            assert workers
            daemon_env = daemon.environ()
            env = {key: daemon_env[key]
                   for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")}  # fmt: skip
            (mps_server,) = _control(env, "get_server_list")
            clients = _control(env, f"get_client_list {mps_server}")
            assert set(workers) <= set(clients), (workers, clients)
        assert not psutil.pid_exists(daemon.pid) or daemon.status() == psutil.STATUS_ZOMBIE
        assert not Path(env["CUDA_MPS_PIPE_DIRECTORY"]).exists()
    finally:
        for region in regions:
            cudashm.destroy_shared_memory_region(region)
