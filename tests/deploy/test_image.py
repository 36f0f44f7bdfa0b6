"""The container image: deploy/docker/Dockerfile, built and run on this machine, driven from
outside by unmodified tritonclient.

No Docker daemon is needed and no base image is pulled (``image_build.py`` says how). The
server runs with the image's own ENTRYPOINT as the image's non-root user, in a container
that shares the host's network and /dev/shm, and the test checks: the image's recipe
(user, ports, entrypoint, health check, size), health over HTTP and gRPC, an inference over
each, the image's HEALTHCHECK command, a system shared-memory inference from a client
process on the host, and a clean stop on SIGTERM.

It takes 3 minutes on a fresh 2-core machine (debootstrap 40-110 s, two builds of about 20 s,
the run 10 s), 40-70 s once the base image is kept; ``deploy/docker/test-image`` runs it
alone and prints each phase's time. It needs root, buildah, debootstrap and Debian's keyring
(``scripts/setup`` installs them where it runs as root on Debian or Ubuntu) and Debian's
mirror; without them it is skipped, saying which is missing. The last test builds
Dockerfile.gpu on the same base (its CUDA base needs a registry).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import image_build as ib
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

EXAMPLES = ib.ROOT / "examples" / "models"
START_DEADLINE_S = 120.0
IMAGE_USER = 1000
MAX_IMAGE_BYTES = 400_000_000  # base ~130 MB + dlserve and its dependencies ~200 MB

pytestmark = [
    pytest.mark.image,
    pytest.mark.timeout(900),  # the first test waits for debootstrap and two builds
    pytest.mark.skipif(ib.missing_tools() is not None, reason=str(ib.missing_tools())),
]


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    container: str
    http: int
    grpc: int
    metrics: int


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def phase(name: str, started: float) -> float:
    now = time.monotonic()
    print(f"image test: {name} took {now - started:.1f} s", file=sys.stderr)
    return now


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The base image and the build context."""
    started = time.monotonic()
    base = ib.base_image()
    started = phase("the base image (debootstrap, or kept from an earlier run)", started)
    folder = ib.build_context(tmp_path_factory.mktemp("context"))
    phase("dlserve's wheel and its dependencies' wheels", started)
    return base, folder


@pytest.fixture(scope="module")
def image(context: tuple[str, Path]) -> Iterator[str]:
    tag = f"localhost/dlserve-test:{uuid.uuid4().hex[:12]}"
    started = time.monotonic()
    base, folder = context
    ib.build_image(tag, folder, base)
    phase(f"buildah bud of {ib.DOCKERFILE.relative_to(ib.ROOT)}", started)
    print(f"image test: image size {ib.image_size(tag) / 1e6:.0f} MB", file=sys.stderr)
    yield tag
    ib.remove_image(tag)


def wait_ready(served: Served) -> None:
    """Ask for readiness until the deadline (the container has no ready pipe)."""
    deadline = time.monotonic() + START_DEADLINE_S
    url = f"http://127.0.0.1:{served.http}/v2/health/ready"
    while True:
        assert served.process.poll() is None, "the server in the container exited"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, "the server in the container did not get ready"


@pytest.fixture(scope="module")
def served(image: str) -> Iterator[Served]:
    started = time.monotonic()
    name = ib.container(image)
    http, grpc, metrics = free_ports(3)
    entrypoint = ib.image_config(image)["Entrypoint"]
    assert isinstance(entrypoint, list)
    ports = ("--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics))
    command = ib.run_command(name, *entrypoint, *ports, volumes=(f"{EXAMPLES}:/models:ro",))
    served = Served(subprocess.Popen(command), name, http, grpc, metrics)
    try:
        wait_ready(served)
        phase("the container's start until ready", started)
        yield served
    finally:
        if served.process.poll() is None:
            served.process.kill()
            served.process.wait()
        ib.remove_container(name)


def test_the_recipe_is_what_the_docs_say(image: str) -> None:
    config = ib.image_config(image)
    assert config["User"] == f"{IMAGE_USER}:{IMAGE_USER}"
    assert set(config["ExposedPorts"]) == {"8000/tcp", "8001/tcp", "8002/tcp"}  # type: ignore[arg-type]
    assert config["Entrypoint"] == [
        "dlserve", "serve", "--model-repository", "/models", "--host", "0.0.0.0",
    ]  # fmt: skip
    health = config["Healthcheck"]
    assert isinstance(health, dict) and health["Test"][0] == "CMD"
    assert ib.image_size(image) < MAX_IMAGE_BYTES


def test_health_and_inference_over_both_protocols(served: Served) -> None:
    a = np.arange(8, dtype=np.float32)
    b = np.ones(8, dtype=np.float32)
    for module, port in ((httpclient, served.http), (grpcclient, served.grpc)):
        client = module.InferenceServerClient(f"127.0.0.1:{port}")
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("add_sub")
        inputs = [module.InferInput(n, [8], "FP32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        result = client.infer("add_sub", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_the_images_healthcheck_passes_and_can_fail(image: str, served: Served) -> None:
    test = ib.image_config(image)["Healthcheck"]["Test"][1:]  # type: ignore[index]
    (dead_port,) = free_ports(1)
    for port, passes in ((served.http, True), (dead_port, False)):
        url = f"http://127.0.0.1:{port}/v2/health/ready"
        command = ib.run_command(served.container, *test, env={"DLSERVE_HEALTH_URL": url})
        done = subprocess.run(command, capture_output=True)
        assert (done.returncode == 0) is passes, done.stderr.decode()[-2000:]


def test_system_shared_memory_from_a_host_process(served: Served) -> None:
    """A region made on the host by unmodified tritonclient and read by the container's
    workers: the container shares the host's /dev/shm (--ipc=host). tritonclient makes its
    objects readable by their owner only, so the server's user (the image's) must own it: a
    root client's object is refused until it is handed to that user."""
    client = httpclient.InferenceServerClient(f"127.0.0.1:{served.http}")
    a = np.arange(16, dtype=np.float32)
    b = np.full(16, 2, dtype=np.float32)
    name = f"image_test_{uuid.uuid4().hex}"
    handle = shm.create_shared_memory_region(name, f"/{name}", 4 * a.nbytes)
    try:
        shm.set_shared_memory_region(handle, [a, b])
        with pytest.raises(InferenceServerException, match="Unable to open shared memory"):
            client.register_system_shared_memory(name, f"/{name}", 4 * a.nbytes)
        os.chown(f"/dev/shm/{name}", IMAGE_USER, IMAGE_USER)
        client.register_system_shared_memory(name, f"/{name}", 4 * a.nbytes)
        inputs = [httpclient.InferInput(n, [16], "FP32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_shared_memory(name, a.nbytes, 0)
        inputs[1].set_shared_memory(name, b.nbytes, a.nbytes)
        outputs = [httpclient.InferRequestedOutput(n) for n in ("OUTPUT0", "OUTPUT1")]
        outputs[0].set_shared_memory(name, a.nbytes, 2 * a.nbytes)
        outputs[1].set_shared_memory(name, a.nbytes, 3 * a.nbytes)
        client.infer("add_sub", inputs, outputs=outputs)
        sums = shm.get_contents_as_numpy(handle, np.float32, [16], offset=2 * a.nbytes)
        differences = shm.get_contents_as_numpy(handle, np.float32, [16], offset=3 * a.nbytes)
        np.testing.assert_array_equal(sums, a + b)
        np.testing.assert_array_equal(differences, a - b)
        client.unregister_system_shared_memory(name)
    finally:
        shm.destroy_shared_memory_region(handle)


def test_the_doctor_tells_a_server_of_another_user(served: Served) -> None:
    """``dlserve doctor`` run here (root) against the container's server (uid 1000): the
    server cannot open the doctor's region until it is made readable by others, which the
    doctor reports as another user, with the fix."""
    done = subprocess.run(
        [sys.executable, "-m", "dlserve.doctor", "--json", "--url", f"127.0.0.1:{served.http}"],
        capture_output=True,
        text=True,
    )
    rows = {row["check"]: row for row in json.loads(done.stdout)["checks"]}
    row = rows["shared memory with server"]
    assert done.returncode == 1 and row["result"] == "fail", row
    assert "another user" in row["found"] and "uid 1000" in row["fix"]


def server_process(served: Served) -> psutil.Process:
    """The container's ``dlserve serve`` (buildah kills, not signals, its child on SIGTERM;
    ``docker stop`` signals the container's first process, which this is)."""
    for child in psutil.Process(served.process.pid).children(recursive=True):
        if child.cmdline()[:3] == ["/opt/dlserve/bin/python", "/opt/dlserve/bin/dlserve", "serve"]:
            return child
    raise AssertionError("no dlserve serve in the container")


def test_sigterm_stops_it_cleanly(served: Served) -> None:
    server_process(served).send_signal(signal.SIGTERM)
    assert served.process.wait(60) == 0
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{served.http}/v2/health/live", timeout=2)


def test_the_gpu_recipe_builds_and_runs_the_doctor(context: tuple[str, Path]) -> None:
    """Dockerfile.gpu on the Debian base in place of its CUDA base (which needs a registry):
    its apt step, the ``gpu`` extra (cuda-python, NVML's bindings) and its user are checked;
    in the container the doctor runs, finds no GPU here and fails ``--gpu`` with its fix."""
    base, folder = context
    tag = f"localhost/dlserve-gpu-test:{uuid.uuid4().hex[:12]}"
    started = time.monotonic()
    ib.build_image(tag, folder, base, ib.GPU_DOCKERFILE)
    phase(f"buildah bud of {ib.GPU_DOCKERFILE.relative_to(ib.ROOT)}", started)
    print(f"image test: GPU recipe's image size {ib.image_size(tag) / 1e6:.0f} MB", file=sys.stderr)
    name = ib.container(tag)
    try:
        imports = ib.run_command(name, "python3", "-c", "import cuda.bindings.runtime, pynvml")
        assert subprocess.run(imports, capture_output=True).returncode == 0
        doctor = ib.run_command(name, "dlserve", "doctor", "--gpu", "--json")
        done = subprocess.run(doctor, capture_output=True, text=True)
        rows = {row["check"]: row for row in json.loads(done.stdout)["checks"]}
        assert done.returncode == 1 and rows["GPUs"]["result"] == "fail", done.stdout
        assert rows["/dev/shm writable"]["result"] == "ok"
        assert ib.image_config(tag)["User"] == f"{IMAGE_USER}:{IMAGE_USER}"
    finally:
        ib.remove_container(name)
        ib.remove_image(tag)
