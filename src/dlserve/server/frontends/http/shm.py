"""HTTP translation for system and CUDA shared memory: region parameters, and the
``/v2/systemsharedmemory`` and ``/v2/cudasharedmemory`` routes.

Shapes and messages are Triton's (``src/http_server.cc``): a status is a JSON list of
``{"name", "key", "offset", "byte_size"}``; register takes ``{"key", "offset",
"byte_size"}`` (offset optional); the region parameters of a tensor are unsigned integers.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from dlserve import errors
from dlserve.server.core.service import InferenceService
from dlserve.tensors.cuda_ipc import HANDLE_SIZE
from dlserve.types import Parameters, Peer, RegionRef, RegionStatus

JsonObject = dict[str, Any]
ReadJson = Callable[[Request, str], Awaitable[JsonObject]]
Encode = Callable[[object], bytes]
CLIENT_PID_HEADER = "dlserve-client-pid"  # the pid a client says it has (server/core/shm/owners.py)
# Triton's HTTP register handler, for a handle that does not decode to 64 bytes.
BAD_HANDLE = "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"


# --- tensors ---------------------------------------------------------------------------


def region_of(params: Parameters) -> RegionRef:
    """The region an input's or output's parameters name (``shared_memory_region`` set)."""
    region = params["shared_memory_region"]
    if type(region) is not str:
        raise errors.InvalidArgumentError("Unable to parse 'shared_memory_region'")
    offset = _unsigned(params, "shared_memory_offset")
    byte_size = _unsigned(params, "shared_memory_byte_size")
    return RegionRef(region, byte_size, offset)


def _unsigned(params: Parameters | JsonObject, key: str) -> int:
    value = params.get(key, 0)
    if type(value) is not int or value < 0:
        raise errors.InvalidArgumentError(f"Unable to parse '{key}'")
    return value


def without_region_keys(params: Parameters) -> Parameters:
    return {k: v for k, v in params.items() if not k.startswith("shared_memory_")}


def peer_of(client: object, pid: str = "") -> Peer:
    """The ASGI scope's "client": (host, port) over TCP, None over a Unix socket; ``pid``:
    the one the client claims (its ``dlserve-client-pid`` header)."""
    claimed = int(pid) if pid.isdigit() else None
    if client is None:
        return Peer(None, pid=claimed)
    if isinstance(client, tuple | list) and client and isinstance(client[0], str):
        port = client[1] if len(client) > 1 and isinstance(client[1], int) else None
        return Peer(client[0], port, claimed)
    return Peer("")


# --- routes ----------------------------------------------------------------------------


class SharedMemoryRoutes:
    """The routes of one kind of shared memory, answered by the service: system
    (``/v2/systemsharedmemory``) or CUDA (``/v2/cudasharedmemory``), each
    ``[/region/{name}]/status|register|unregister``; ``read_json`` reads a bounded JSON
    body. The kinds differ in a status entry's fields and in what register takes; the
    rest is one code path."""

    def __init__(
        self, service: InferenceService, read_json: ReadJson, encode: Encode, *, cuda: bool
    ) -> None:
        self.service = service
        self.read_json = read_json
        self.encode = encode
        self.cuda = cuda
        self.prefix = "/v2/cudasharedmemory" if cuda else "/v2/systemsharedmemory"
        self._entry = _cuda_entry if cuda else _system_entry
        self._register = self._register_cuda if cuda else self._register_system

    def routes(self) -> list[Route]:
        get, post, prefix = ["GET"], ["POST"], self.prefix
        region = f"{prefix}/region/{{region}}"
        return [
            Route(f"{prefix}/status", self.status, methods=get),
            Route(f"{region}/status", self.status, methods=get),
            Route(f"{prefix}/register", self.register, methods=post),
            Route(f"{region}/register", self.register, methods=post),
            Route(f"{prefix}/unregister", self.unregister, methods=post),
            Route(f"{region}/unregister", self.unregister, methods=post),
        ]

    async def status(self, request: Request) -> Response:
        regions = self.service.shared_memory.status(
            request.path_params.get("region", ""), cuda=self.cuda
        )
        body = [self._entry(region) for region in regions]
        return Response(self.encode(body), media_type="application/json")

    async def register(self, request: Request) -> Response:
        name = request.path_params.get("region", "")
        peer = peer_of(request.scope.get("client"), request.headers.get(CLIENT_PID_HEADER, ""))
        body = await self.read_json(request, "shared memory register")
        await self._register(name, body, peer)
        return Response(status_code=200, media_type="application/json")

    async def unregister(self, request: Request) -> Response:
        name = request.path_params.get("region", "")
        self.service.shared_memory.unregister(
            name, peer_of(request.scope.get("client")), cuda=self.cuda
        )
        return Response(status_code=200, media_type="application/json")

    async def _register_system(self, name: str, body: JsonObject, peer: Peer) -> None:
        """``{"key", "offset", "byte_size"}`` (offset optional)."""
        key = body.get("key")
        if key is None:
            raise errors.InvalidArgumentError("Shared memory register request has no 'key' field")
        if type(key) is not str:
            raise errors.InvalidArgumentError("Unable to parse 'key'")
        if "byte_size" not in body:
            raise errors.InvalidArgumentError(
                "Shared memory register request has no 'byte_size' field"
            )
        offset, byte_size = _unsigned(body, "offset"), _unsigned(body, "byte_size")
        await self.service.shared_memory.register(name, key, offset, byte_size, peer)

    async def _register_cuda(self, name: str, body: JsonObject, peer: Peer) -> None:
        """``{"raw_handle": {"b64": ...}, "device_id", "byte_size"}``."""
        raw = body.get("raw_handle")
        if raw is None:
            raise errors.InvalidArgumentError(
                "Shared memory register request has no 'raw_handle' field"
            )
        if not isinstance(raw, dict) or type(raw.get("b64")) is not str:
            raise errors.InvalidArgumentError("Unable to parse 'b64'")
        for key in ("byte_size", "device_id"):
            if key not in body:
                raise errors.InvalidArgumentError(
                    f"Shared memory register request has no '{key}' field"
                )
        byte_size, device_id = _unsigned(body, "byte_size"), _unsigned(body, "device_id")
        handle = _handle(raw["b64"])
        await self.service.shared_memory.register_cuda(name, handle, device_id, byte_size, peer)


def _system_entry(region: RegionStatus) -> JsonObject:
    return {"name": region.name, "key": region.key, "offset": region.offset,
            "byte_size": region.byte_size}  # fmt: skip


def _cuda_entry(region: RegionStatus) -> JsonObject:
    return {"name": region.name, "device_id": region.device_id, "byte_size": region.byte_size}


def _handle(text: str) -> bytes:
    """The cudaIpcMemHandle_t a register body carries, checked as Triton's HTTP frontend
    checks it (before anything is opened)."""
    try:
        handle = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise errors.InvalidArgumentError(BAD_HANDLE) from None
    if len(handle) != HANDLE_SIZE:
        raise errors.InvalidArgumentError(BAD_HANDLE)
    return handle
