"""The server's side, seen from this process: can the server open a shared-memory object this
process made (one IPC namespace, and a user that may open it), and does it see the same GPUs."""

from __future__ import annotations

import os
import re
import urllib.request
import uuid
from typing import Any, Final
from urllib.parse import urlsplit

from dlserve.doctor.report import Row

REGION_BYTES: Final = 4096
IPC_FIX: Final = (
    "run the client and the server in one IPC namespace with one /dev/shm: "
    "docker: --ipc=host on both (or --ipc=container:SERVER); Kubernetes: one "
    "pod, or hostIPC (deploy/kubernetes/overlays/shm-clients); else send tensors "
    "over the wire"
)
USER_FIX: Final = (
    "run the client as the server's user (the image's is uid 1000), or make "
    "the objects readable and writable by it (fchmod)"
)


def client_for(url: str) -> Any:
    """tritonclient for ``url``: ``host:port`` or ``http://...`` (HTTP), ``grpc://host:port``
    or ``unix:PATH`` (gRPC)."""
    if url.startswith(("grpc://", "unix:")):
        import tritonclient.grpc as grpcclient

        return grpcclient.InferenceServerClient(url.removeprefix("grpc://"))
    import tritonclient.http as httpclient

    return httpclient.InferenceServerClient(re.sub(r"^https?://", "", url))


def reachable(client: Any, url: str) -> Row:
    try:
        live = client.is_server_live()
    except Exception as exc:  # tritonclient raises its own and the transports' errors
        return Row("server", "fail", f"{url}: {exc}", "start the server, or give its --url")
    return Row("server", "ok" if live else "fail", f"{url}: {'live' if live else 'not live'}")


def shared_ipc(client: Any) -> Row:
    """Register a region of this process's and read its status back; when the server
    cannot open it, tell a foreign namespace from a foreign user."""
    name = f"doctor_{os.getpid()}_{uuid.uuid4().hex[:8]}"  # dlserve_: reserved
    path = f"/dev/shm/{name}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # as tritonclient does
    except OSError as exc:
        return Row(
            "shared memory with server",
            "fail",
            f"cannot make a region here: {exc.strerror}",
            "see /dev/shm writable",
        )
    try:
        os.write(fd, os.urandom(REGION_BYTES))
        error = _register(client, name)
        if error and "Unable to open" in error:
            os.fchmod(fd, 0o666)
            if _register(client, name) is None:
                return Row(
                    "shared memory with server",
                    "fail",
                    "the server is another user: it cannot open this user's objects "
                    "(mode 0600, as tritonclient makes them)",
                    USER_FIX,
                )
            return Row(
                "shared memory with server",
                "fail",
                f"the server cannot open this process's objects: {error}",
                IPC_FIX,
            )
        if error:
            return Row(
                "shared memory with server",
                "warn",
                error,
                "client shared memory is off or refused for this client "
                "(--allow-client-shm); tensors go over the wire",
            )
        return _read_back(client, name)
    finally:
        os.close(fd)
        os.unlink(path)


def _register(client: Any, name: str) -> str | None:
    try:
        client.register_system_shared_memory(name, f"/{name}", REGION_BYTES)
    except Exception as exc:  # InferenceServerException: the server's message
        return str(exc)
    return None


def _read_back(client: Any, name: str) -> Row:
    try:
        status = client.get_system_shared_memory_status(region_name=name)
    finally:
        client.unregister_system_shared_memory(name)
    text = str(status)
    if name in text and str(REGION_BYTES) in text:
        return Row(
            "shared memory with server",
            "ok",
            "the server opened a region of this process's and listed it back",
        )
    return Row("shared memory with server", "fail", f"status did not list it: {text}", IPC_FIX)


def server_gpus(metrics_url: str, ours: list[str]) -> Row:
    """The GPUs the server's NVML reports (its metrics' gpu_uuid labels) against ours."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=10) as response:
            text = response.read().decode()
    except OSError as exc:
        return Row(
            "GPUs of the server",
            "skip",
            f"{metrics_url}: {exc}",
            "give the server's metrics endpoint: --metrics-url",
        )
    theirs = set(re.findall(r'^nv_gpu_utilization\{gpu_uuid="([^"]+)"', text, re.MULTILINE))
    if not ours and not theirs:
        return Row("GPUs of the server", "skip", "no GPU here or there")
    if not theirs:
        return Row(
            "GPUs of the server",
            "warn",
            "the server reports no GPU",
            "give its container the GPUs (--gpus, nvidia.com/gpu), or --allow-gpu-metrics true",
        )
    missing = sorted(set(ours) - theirs)
    if missing:
        return Row(
            "GPUs of the server",
            "warn",
            f"the server does not see {', '.join(missing)}",
            "CUDA regions on those GPUs cannot be opened by its workers: give it the same GPUs",
        )
    return Row(
        "GPUs of the server", "ok", f"{len(theirs)} (NVML's view), this process's among them"
    )


def default_metrics_url(url: str) -> str:
    host = urlsplit(url if "//" in url else f"//{url}").hostname or "localhost"
    return f"http://{host}:8002/metrics"
