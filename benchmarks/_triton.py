"""Start the real Triton server, or dlserve, as a subprocess for a benchmark.

The real Triton comes from the PyPI wheel ``nvidia-pytriton`` (it ships
``tritonserver``, its Python backend and one backend stub per Python version).
``ensure_triton()`` unpacks it under ``.bench/`` (git-ignored), once:

1. ``pip download nvidia-pytriton==0.7.0 --no-deps`` into ``.bench/wheels``.
2. Unzip the wheel into ``.bench/pytriton`` (zip loses the exec bits: restore them).
3. Copy ``python_backend_stubs/<X.Y>/triton_python_backend_stub`` into
   ``backends/python/``: the Python backend looks for its stub there.
4. ``pip install --target .bench/np1 'numpy<2'`` (the stub is built against the
   numpy 1 ABI) and symlink ``numpy`` and ``numpy.libs`` into ``backends/python/``.
   PYTHONPATH does not work for this: the stub embeds Python in *isolated* mode
   (``sys.flags.isolated == 1``, environment ignored), and its ``sys.path`` is the
   system Python's (``/usr/lib/python3.X``, the ``dist-packages`` folders), the
   model's folder and ``backends/python``; the last one is ours to fill.
5. Where this Python has torch (the GPU models import it), link every package of the
   folder that holds torch into ``backends/python/`` too, numpy excepted.

At run time ``tritonserver`` needs the wheel's ``nvidia_pytriton.libs`` on
``LD_LIBRARY_PATH``, and the stub needs the system's ``libpython3.X.so.1.0``
(Debian package ``libpython3.X``). Without a GPU Triton logs CUDA, NVML and DCGM
warnings at startup and runs on the CPU.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.util
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO_ROOT / ".bench"
PYTRITON_VERSION = "0.7.0"
WHEEL_DIR = BENCH_DIR / "wheels"
PYTRITON_DIR = BENCH_DIR / "pytriton"
NUMPY_DIR = BENCH_DIR / "np1"
TRITON_HOME = PYTRITON_DIR / "pytriton" / "tritonserver"
TRITON_LIBS = PYTRITON_DIR / "nvidia_pytriton.libs"
STUB_NAME = "triton_python_backend_stub"

READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
TRITON_EXIT_TIMEOUT_S = 10  # < STOP_TIMEOUT_S: Triton exits by itself, removing its shm
POLL_INTERVAL_S = 0.05
LOG_TAIL_BYTES = 4000


@dataclass(frozen=True)
class RunningServer:
    """A server started by ``run_triton`` or ``run_dlserve``, ready for requests."""

    name: str
    process: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    metrics_port: int

    @property
    def http_url(self) -> str:
        """``host:port`` as tritonclient.http expects it."""
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """``host:port`` as tritonclient.grpc expects it."""
        return f"127.0.0.1:{self.grpc_port}"


class ServerStartError(RuntimeError):
    """The server died or did not become ready before its deadline."""


# --- shared helpers -------------------------------------------------------------


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports (all sockets held open while choosing)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def is_ready(http_port: int) -> bool:
    """Whether GET /v2/health/ready answers 200."""
    url = f"http://127.0.0.1:{http_port}/v2/health/ready"
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return bool(response.status == 200)
    except (OSError, http.client.HTTPException):  # refused, reset, timed out, 503...
        return False


def log_tail(log: IO[bytes], limit: int = LOG_TAIL_BYTES) -> str:
    """The last ``limit`` bytes of a server's combined stdout/stderr.

    pread, not seek: the server writes through a duplicate of this file's
    descriptor, which shares its offset.
    """
    size = os.fstat(log.fileno()).st_size
    start = max(0, size - limit)
    return os.pread(log.fileno(), size - start, start).decode(errors="replace")


def wait_ready(
    process: subprocess.Popen[bytes], http_port: int, log: IO[bytes], timeout_s: float
) -> None:
    """Poll the readiness endpoint until it answers 200; raise if the server dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerStartError(
                f"server exited with code {process.returncode}:\n{log_tail(log)}"
            )
        if is_ready(http_port):
            return
        time.sleep(POLL_INTERVAL_S)
    raise ServerStartError(f"server not ready after {timeout_s:.0f} s:\n{log_tail(log)}")


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, then SIGKILL to the whole process group after ``timeout_s``.

    The server runs in its own session (see ``run_server``), so its group holds
    its model processes (Triton's backend stubs, dlserve's workers) too.
    """
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=timeout_s)


@contextlib.contextmanager
def run_server(
    name: str,
    command: Sequence[str],
    env: dict[str, str],
    ports: tuple[int, int, int],
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Iterator[RunningServer]:
    """Start ``command``, yield once it is ready, stop it on exit.

    ``ports`` is (http, grpc, metrics). Output goes to a temporary file, not a
    pipe, so a chatty server never blocks on a full pipe.
    """
    http_port, grpc_port, metrics_port = ports
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            list(command), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            wait_ready(process, http_port, log, ready_timeout_s)
            yield RunningServer(name, process, http_port, grpc_port, metrics_port)
        finally:
            stop_process(process)


# --- the real Triton --------------------------------------------------------------


def python_tag() -> str:
    """``X.Y`` of the running interpreter: which backend stub to use."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def pip(*args: str) -> None:
    """Run this interpreter's pip (default index)."""
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def download_wheel() -> Path:
    """Step 1: the nvidia-pytriton wheel in .bench/wheels (downloaded if missing)."""
    pattern = f"nvidia_pytriton-{PYTRITON_VERSION}-*.whl"
    found = sorted(WHEEL_DIR.glob(pattern))
    if not found:
        requirement = f"nvidia-pytriton=={PYTRITON_VERSION}"
        pip("download", requirement, "--no-deps", "--dest", str(WHEEL_DIR))
        found = sorted(WHEEL_DIR.glob(pattern))
    if not found:
        raise FileNotFoundError(f"no {pattern} in {WHEEL_DIR} after pip download")
    return found[-1]


def make_executable(path: Path) -> None:
    """Add the exec bits that unzipping drops."""
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def extract_wheel(wheel: Path) -> None:
    """Step 2: unzip the wheel into .bench/pytriton (into a temp dir, then rename)."""
    if (TRITON_HOME / "bin" / "tritonserver").exists():
        return
    staging = Path(tempfile.mkdtemp(prefix="pytriton-", dir=BENCH_DIR))
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(staging)
    make_executable(staging / "pytriton" / "tritonserver" / "bin" / "tritonserver")
    staging.chmod(0o755)
    shutil.rmtree(PYTRITON_DIR, ignore_errors=True)
    staging.rename(PYTRITON_DIR)


def install_stub() -> None:
    """Step 3: the backend stub for this Python version, where the backend looks for it."""
    source = TRITON_HOME / "python_backend_stubs" / python_tag() / STUB_NAME
    target = TRITON_HOME / "backends" / "python" / STUB_NAME
    if not target.exists():  # a copied .bench/ may hold the stub alone, the others left out
        if not source.exists():
            raise FileNotFoundError(f"the wheel has no backend stub for Python {python_tag()}")
        shutil.copy2(source, target)
    make_executable(target)


def install_numpy() -> None:
    """Step 4: numpy<2 in .bench/np1, linked into backends/python (on the stub's path)."""
    if not (NUMPY_DIR / "numpy" / "__init__.py").exists():
        staging = Path(tempfile.mkdtemp(prefix="np1-", dir=BENCH_DIR))
        pip("install", "--quiet", "--target", str(staging), "numpy<2")
        staging.chmod(0o755)
        shutil.rmtree(NUMPY_DIR, ignore_errors=True)
        staging.rename(NUMPY_DIR)
    backend_dir = TRITON_HOME / "backends" / "python"
    for name in ("numpy", "numpy.libs"):
        link = backend_dir / name
        if (NUMPY_DIR / name).exists() and not link.is_symlink():
            link.symlink_to(os.path.relpath(NUMPY_DIR / name, backend_dir))


def link_torch() -> None:
    """Step 5: torch's folder of packages (numpy excepted) linked into backends/python."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return
    packages = Path(spec.origin).resolve().parents[1]
    backend_dir = TRITON_HOME / "backends" / "python"
    for entry in packages.iterdir():
        link = backend_dir / entry.name
        if entry.name.startswith(("numpy", "_", ".")) or link.exists() or link.is_symlink():
            continue
        link.symlink_to(entry)


def ensure_triton() -> Path:
    """Install the real Triton under .bench/ unless already there; return its home.

    The home holds ``bin/tritonserver`` and ``backends/``.
    """
    BENCH_DIR.mkdir(exist_ok=True)
    WHEEL_DIR.mkdir(exist_ok=True)
    if not (TRITON_HOME / "bin" / "tritonserver").exists():  # a copied .bench/ needs no wheel
        extract_wheel(download_wheel())
    install_stub()
    install_numpy()
    link_torch()
    return TRITON_HOME


def triton_env() -> dict[str, str]:
    """This environment plus the wheel's bundled libraries on LD_LIBRARY_PATH, less any
    virtual environment: the backend stub's embedded Python finds its home through PATH,
    and an activated venv's ``python3`` there would give it the venv's numpy 2 (the stub
    needs numpy<2: its tensors came out garbled, its outputs empty)."""
    env = dict(os.environ)
    parts = [str(TRITON_LIBS), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in parts if p)
    path = env.get("PATH", "").split(os.pathsep)
    env["PATH"] = os.pathsep.join(p for p in path if p and not _in_venv(Path(p)))
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONHOME", None)
    return env


def _in_venv(folder: Path) -> bool:
    """Whether ``folder`` is a virtual environment's bin folder."""
    return (folder.parent / "pyvenv.cfg").is_file()


def triton_command(
    home: Path, model_repository: Path, ports: tuple[int, int, int], shm_prefix: str
) -> list[str]:
    """The tritonserver command line, listening on the loopback interface only."""
    http_port, grpc_port, metrics_port = ports
    return [
        str(home / "bin" / "tritonserver"),
        f"--model-repository={model_repository}",
        f"--backend-directory={home / 'backends'}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        "--http-address=127.0.0.1",
        "--grpc-address=127.0.0.1",
        f"--exit-timeout-secs={TRITON_EXIT_TIMEOUT_S}",
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
    ]


def remove_shm_regions(prefix: str) -> None:
    """Delete the Python backend's /dev/shm regions that an unclean exit left behind."""
    for path in Path("/dev/shm").glob(f"{prefix}*"):
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def run_triton(
    model_repository: Path, http_port: int, grpc_port: int, metrics_port: int
) -> Iterator[RunningServer]:
    """Run the real tritonserver on ``model_repository`` until the block exits."""
    home = ensure_triton()
    ports = (http_port, grpc_port, metrics_port)
    shm_prefix = f"bench_triton_{os.getpid()}_{http_port}_"
    command = triton_command(home, Path(model_repository).resolve(), ports, shm_prefix)
    try:
        with run_server("triton", command, triton_env(), ports) as server:
            yield server
    finally:
        remove_shm_regions(shm_prefix)


# --- dlserve ------------------------------------------------------------------------


def dlserve_env() -> dict[str, str]:
    """This environment with the repository's src/ on PYTHONPATH (works uninstalled)."""
    env = dict(os.environ)
    parts = [str(REPO_ROOT / "src"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in parts if p)
    return env


@contextlib.contextmanager
def run_dlserve(
    model_repository: Path, http_port: int, grpc_port: int, metrics_port: int, *extra: str
) -> Iterator[RunningServer]:
    """Run ``python -m dlserve serve`` on ``model_repository`` until the block exits."""
    command = [
        sys.executable, "-m", "dlserve", "serve",
        "--model-repository", str(Path(model_repository).resolve()),
        "--http-port", str(http_port),
        "--grpc-port", str(grpc_port),
        "--metrics-port", str(metrics_port), *extra,
    ]  # fmt: skip
    ports = (http_port, grpc_port, metrics_port)
    with run_server("dlserve", command, dlserve_env(), ports) as server:
        yield server
