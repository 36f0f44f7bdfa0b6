"""``dlserve doctor``: it passes on a sound host, and each failure it is built to find is made
for real and reported with its fix and a non-zero exit status.

- a /dev/shm too small, and one read-only: a tmpfs mounted over /dev/shm in a mount
  namespace of the doctor's own (``unshare --mount``);
- a server in another IPC namespace with a /dev/shm of its own (``unshare --ipc --mount``, as
  a container without ``--ipc=host``): it cannot open the doctor's region;
- a cgroup memory limit below what a repository's instances need: the doctor runs in a child
  memory cgroup of the test's, with a 512 MiB limit;
- no GPU when the models need one (``--gpu``) on a host where NVML lists none.

Built elsewhere: a server running as another user (this machine's Python is under /root,
mode 0700, so no other uid can start it here; tests/deploy/test_image.py runs the doctor
against the image's server, uid 1000). Not built: a failing CUDA IPC or peer access (no GPU
on this machine: those rows are skipped and say so).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import EXAMPLES, TEST_MODELS, RunningServer, repository_of, run_server
from dlserve.server.core.host.devices import gpu_count

HAS_GPU = gpu_count() > 0

DOCTOR = (sys.executable, "-m", "dlserve", "doctor", "--json")


def can_unshare() -> bool:
    done = subprocess.run(["unshare", "--mount", "--ipc", "true"], capture_output=True)
    return done.returncode == 0


needs_namespaces = pytest.mark.skipif(
    not can_unshare(), reason="unshare --mount --ipc is not permitted here (needs root)"
)


def doctor(*args: str, prefix: tuple[str, ...] = ()) -> tuple[int, dict[str, dict[str, Any]]]:
    """Run the doctor; its exit status and its rows by check."""
    done = subprocess.run([*prefix, *DOCTOR, *args], capture_output=True, text=True, timeout=120)
    assert done.stdout, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] == (done.returncode == 0)
    return done.returncode, {row["check"]: row for row in report["checks"]}


def in_shm(mount_options: str) -> tuple[str, ...]:
    """A prefix that runs a command with a fresh tmpfs (these options) over /dev/shm."""
    script = f'mount -t tmpfs -o {mount_options} tmpfs /dev/shm && exec "$@"'
    return ("unshare", "--mount", "sh", "-c", script, "sh")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repository = repository_of(tmp_path_factory.mktemp("repo"), EXAMPLES / "add_sub")
    socket = tmp_path_factory.mktemp("uds") / "dlserve.sock"
    with run_server(repository, "--grpc-uds", str(socket)) as server:
        yield server


def test_passes_on_this_host(server: RunningServer) -> None:
    status, rows = doctor("--url", server.http_url, "--metrics-url", server.metrics_url)
    assert status == 0, rows
    for check in ("/dev/shm size", "/dev/shm writable", "server", "shared memory with server"):
        assert rows[check]["result"] == "ok", rows[check]
    assert all(row["result"] != "fail" for row in rows.values())


def test_over_grpc_and_its_unix_socket_too(server: RunningServer) -> None:
    socket = server.process.args[server.process.args.index("--grpc-uds") + 1]  # type: ignore[union-attr]
    for url in (f"grpc://{server.grpc_url}", f"unix://{socket}"):
        status, rows = doctor("--url", url)
        assert status == 0 and rows["shared memory with server"]["result"] == "ok", rows


@needs_namespaces
def test_a_small_dev_shm_fails_with_its_fix() -> None:
    status, rows = doctor(prefix=in_shm("size=64k"))
    assert status == 1
    row = rows["/dev/shm size"]
    assert row["result"] == "fail" and "64 MiB" not in row["found"]
    assert "--shm-size" in row["fix"] and "medium: Memory" in row["fix"]


@needs_namespaces
def test_a_read_only_dev_shm_fails_with_its_fix() -> None:
    status, rows = doctor(prefix=in_shm("ro,size=1g"))
    assert status == 1
    row = rows["/dev/shm writable"]
    assert row["result"] == "fail" and "Read-only" in row["found"], row
    assert "read-write" in row["fix"]


@needs_namespaces
def test_a_server_in_another_ipc_namespace_fails_with_its_fix(tmp_path: Path) -> None:
    repository = repository_of(tmp_path / "repo", EXAMPLES / "add_sub")
    script = 'mount -t tmpfs tmpfs /dev/shm && exec "$@"'
    prefix = ("unshare", "--ipc", "--mount", "sh", "-c", script, "sh")
    with run_server(repository, prefix=prefix) as server:
        status, rows = doctor("--url", server.http_url)
    assert status == 1
    row = rows["shared memory with server"]
    assert row["result"] == "fail" and "cannot open" in row["found"], row
    assert "--ipc=host" in row["fix"] and "hostIPC" in row["fix"]


def memory_cgroup() -> Path | None:
    """This process's cgroup v1 memory folder, if this host has one we may write to."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        folder = Path("/sys/fs/cgroup/memory") / path.strip("/")
        if "memory" in controllers.split(",") and os.access(folder, os.W_OK):
            return folder
    return None


@pytest.mark.skipif(memory_cgroup() is None, reason="no writable cgroup v1 memory folder here")
def test_a_memory_limit_below_the_models_needs_fails_with_its_fix(tmp_path: Path) -> None:
    parent = memory_cgroup()
    assert parent is not None
    child = parent / f"dlserve_doctor_{os.getpid()}"
    child.mkdir()
    try:
        (child / "memory.limit_in_bytes").write_text(str(512 << 20))
        join = f'echo $$ > {child}/cgroup.procs && exec "$@"'
        status, rows = doctor(
            "--model-repository", str(TEST_MODELS), prefix=("sh", "-c", join, "sh")
        )
    finally:
        child.rmdir()
    assert status == 1
    row = rows["memory for the models"]
    assert row["result"] == "fail" and "512 MiB" in row["found"], row
    assert "memory limit" in row["fix"]
    _, unlimited = doctor("--model-repository", str(EXAMPLES))
    assert unlimited["memory for the models"]["result"] == "ok"


def test_no_gpu_when_the_models_need_one_fails_with_its_fix() -> None:
    status, rows = doctor()
    if rows["GPUs"]["result"] == "ok":
        pytest.skip("NVML lists GPUs here: this host cannot be made to have none")
    assert status == 0 and rows["GPUs"]["result"] == "skip"
    status, rows = doctor("--gpu")
    assert status == 1
    row = rows["GPUs"]
    assert row["result"] == "fail" and "--gpus all" in row["fix"] and "nvidia.com/gpu" in row["fix"]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")
def test_a_gpu_host_passes_the_gpu_checks() -> None:
    """On a host with a GPU, ``--gpu`` passes: NVML lists it, the CUDA probe (a child
    process) reads the versions, and another process maps and reads each GPU's memory."""
    status, rows = doctor("--gpu")
    assert rows["GPUs"]["result"] == "ok", rows["GPUs"]
    assert rows["CUDA versions"]["result"] == "ok", rows
    ipc = [row for name, row in rows.items() if name.startswith("CUDA IPC, GPU ")]
    assert ipc and all(row["result"] == "ok" for row in ipc), ipc
    failed = {name: row for name, row in rows.items() if row["result"] == "fail"}
    assert status == 0 and not failed, failed
