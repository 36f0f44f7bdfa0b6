"""The HTTP frontend: KServe v2 + Triton's extensions as an ASGI app.

``POST .../infer`` is the hot path: a raw ASGI callable, reached before any
routing, that reads the body once, hands memoryview slices of it to the core and
writes the JSON header and the output blobs without re-encoding anything. Every
other route is a thin Starlette app. Both translate only; the service decides.

Every body is bounded by ``max_input_size`` before it is read (Content-Length) and
while it streams (chunked). A refused body is answered at once and never held in
memory: what still arrives of it is discarded by the HTTP server as it comes, so that the
client, which may still be sending, reads the answer instead of a reset connection.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any, Final

from starlette.applications import Starlette
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from dlserve import errors
from dlserve.server.core.service import InferenceService
from dlserve.server.core.telemetry.tracer import Trace
from dlserve.server.frontends.http import bodies, convert
from dlserve.server.frontends.http.generate import GenerateEndpoint
from dlserve.server.frontends.http.restrict import RouteGuard
from dlserve.server.frontends.http.shm import SharedMemoryRoutes, peer_of
from dlserve.server.frontends.http.status_codes import error_body, error_reply
from dlserve.server.frontends.requests import checked_version
from dlserve.server.frontends.restrictions import Restrictions
from dlserve.server.transport.http1.exchange import CANCEL_ON_CLOSE, RECEIVED_NS
from dlserve.types import InferRequest

log = logging.getLogger("dlserve.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# A version in a path is digits, as Triton's routes have it: /versions/-1/infer is no route.
_INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([0-9]+))?/infer")
_JSON = (b"content-type", b"application/json")
_OCTETS = (b"content-type", b"application/octet-stream")
_JOIN_LIMIT = 64 * 1024  # below this, one joined body beats several sends
_OPENAPI = Path(__file__).resolve().parents[5] / "docs" / "openapi.json"


class _VersionConvertor(Convertor[str]):
    """``{version:version}``: a model version in a path, digits only (as Triton's routes)."""

    regex = "[0-9]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("version", _VersionConvertor())


def create_http_app(
    service: InferenceService, max_input_size: int = 64 * 2**20,
    restrictions: Restrictions | None = None,
) -> HttpApp:  # fmt: skip
    """The ASGI app that serves ``service`` over HTTP; ``restrictions``: groups of routes
    that only requests with a header may use."""
    return HttpApp(service, max_input_size, restrictions or {})


# --- the hot path -----------------------------------------------------------------------


async def send_reply(
    send: Send, status: int, headers: list[tuple[bytes, bytes]], parts: list[bytes | memoryview]
) -> None:
    total = sum(len(p) if type(p) is bytes else memoryview(p).nbytes for p in parts)
    headers.append((b"content-length", str(total).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    if len(parts) == 1 or total <= _JOIN_LIMIT:
        await send({"type": "http.response.body", "body": b"".join(parts)})
        return
    last = len(parts) - 1
    for index, part in enumerate(parts):
        body = part.cast("B") if isinstance(part, memoryview) else part
        await send({"type": "http.response.body", "body": body, "more_body": index < last})


class InferEndpoint:
    """``POST /v2/models/{model}[/versions/{version}]/infer`` as a raw ASGI app."""

    def __init__(self, service: InferenceService, limit: int) -> None:
        self.service = service
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        params = scope["path_params"]  # reached through the router (the fast path skips it)
        await self.handle(params["model"], params.get("version", ""), scope, receive, send)

    async def handle(
        self, model: str, version: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        parts: list[bytes | memoryview]
        scope[CANCEL_ON_CLOSE] = True  # a client that goes away leaves the queue
        received = scope.get(RECEIVED_NS)  # there while tracing is on
        trace = self._trace(model, received) if received is not None else None
        try:
            try:
                headers = bodies.scan_headers(scope["headers"])
                client = scope.get("client")
                status, out, parts = await self._infer(
                    model, version, headers, receive, client, trace
                )
            except errors.DlserveError as exc:
                status, body = error_reply(exc)
                out, parts = [_JSON], [body]
            except Exception as exc:  # a bug: answer, log, keep serving
                log.exception("infer on model '%s' failed", model)
                status, out, parts = 500, [_JSON], [error_body(f"internal error: {exc!r}")]
            if trace is not None:
                trace.stamp("HTTP_SEND_START", time.monotonic_ns())
            await send_reply(send, status, out, parts)
        finally:
            if trace is not None:
                trace.stamp("HTTP_SEND_END", time.monotonic_ns())
                trace.release()

    def _trace(self, model: str, received: int) -> Trace | None:
        """The request's trace when its model's setting samples it."""
        trace = self.service.tracer.sample(model)
        if trace is not None:
            trace.stamp("HTTP_RECV_START", received)
        return trace

    async def _infer(
        self, model: str, version: str, headers: bodies.Headers, receive: Receive, client: object,
        trace: Trace | None,
    ) -> tuple[int, list[tuple[bytes, bytes]], list[bytes | memoryview]]:  # fmt: skip
        version = checked_version(version)
        body: bytes | bytearray
        body = await bodies.read_body(receive, headers.content_length, self.limit)
        if trace is not None:
            trace.stamp("HTTP_RECV_END", time.monotonic_ns())
        if headers.content_encoding:
            body = await bodies.decompress(body, headers.content_encoding, self.limit)
        length = bodies.header_length(headers.header_length, len(body))
        if length:
            request, plan = convert.parse_infer_request(body, length, model, version)
        else:  # raw binary: the outputs come back as binary data, as Triton sends them
            raw = self.service.raw_input(model, version, memoryview(body))
            request, plan = InferRequest(model, version, "", [raw], []), convert.OutputPlan(True)
        request.peer = peer_of(client)
        try:
            response = await self.service.infer(request, trace=trace)
        except errors.DecoupledModelError:
            raise errors.UnsupportedError(
                "HTTP end point doesn't support models with decoupled transaction policy"
            ) from None
        if trace is not None:
            trace.stamp("INFER_RESPONSE_COMPLETE", time.monotonic_ns())
        header, blobs = convert.encode_infer_response(response, plan)
        parts: list[bytes | memoryview] = [header, *blobs]
        out = [_OCTETS, (b"inference-header-content-length", str(len(header)).encode())]
        if not blobs:
            out = [_JSON]
        encoding = bodies.response_encoding(headers.accept_encoding)
        if encoding:
            parts = [bodies.compress(parts, encoding)]
            out.append((b"content-encoding", encoding))
        return 200, out, parts


# --- the other routes -------------------------------------------------------------------


def _json(value: object, status: int = 200) -> Response:
    return Response(convert.encode_json(value), status, media_type="application/json")


def _versioned(path: str, endpoint: Any, methods: list[str]) -> list[Route]:
    """A model route and its ``/versions/{version}`` twin."""
    return [
        Route(f"/v2/models/{{model}}{path}", endpoint, methods=methods),
        Route(
            f"/v2/models/{{model}}/versions/{{version:version}}{path}", endpoint, methods=methods
        ),
    ]


class HttpApp:
    """The ASGI app: the infer fast path, then the Starlette router for the rest."""

    def __init__(
        self, service: InferenceService, max_input_size: int, restrictions: Restrictions
    ) -> None:
        self.service = service
        self.limit = max_input_size
        self.infer = InferEndpoint(service, max_input_size)
        routes = self._routes()
        self.router = Starlette(routes=routes, exception_handlers={
            errors.DlserveError: _dlserve_error, HTTPException: _http_error,
        })  # fmt: skip
        self.guard = RouteGuard(routes, restrictions) if restrictions else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.guard is not None and await self.guard.refused(scope, send):
            return
        if scope["type"] == "http" and scope["method"] == "POST":
            match = _INFER_PATH.fullmatch(scope["path"])
            if match is not None:
                await self.infer.handle(match[1], match[2] or "", scope, receive, send)
                return
        await self.router(scope, receive, send)

    def _routes(self) -> list[Route]:
        get, post, both = ["GET"], ["POST"], ["GET", "POST"]
        return [
            Route("/v2/health/live", self.live, methods=get),
            Route("/v2/health/ready", self.ready, methods=get),
            Route("/v2", self.server_metadata, methods=get),
            Route("/v2/openapi.json", self.openapi, methods=get),
            Route("/v2/models/stats", self.stats, methods=get),
            *_versioned("", self.model_metadata, get),
            *_versioned("/ready", self.model_ready, get),
            *_versioned("/config", self.model_config, get),
            *_versioned("/stats", self.stats, get),
            *_versioned("/infer", self.infer, post),
            *_versioned("/generate", GenerateEndpoint(self.service, self._raw_body, False), post),
            *_versioned(
                "/generate_stream", GenerateEndpoint(self.service, self._raw_body, True), post
            ),
            Route("/v2/models/{model}/trace/setting", self.trace_setting, methods=both),
            Route("/v2/trace/setting", self.trace_setting, methods=both),
            Route("/v2/repository/index", self.repository_index, methods=post),
            Route("/v2/repository/models/{model}/load", self.load, methods=post),
            Route("/v2/repository/models/{model}/unload", self.unload, methods=post),
            Route("/v2/logging", self.logging, methods=both),
            *SharedMemoryRoutes(self.service, self._body, convert.encode_json, cuda=False).routes(),
            *SharedMemoryRoutes(self.service, self._body, convert.encode_json, cuda=True).routes(),
        ]

    async def _raw_body(self, scope: Scope, receive: Receive) -> bytes:
        headers = bodies.scan_headers(scope["headers"])
        return await bodies.read_body(receive, headers.content_length, self.limit)

    async def _body(
        self, request: Request, what: str, required: bool = False
    ) -> convert.JsonObject:
        """The request's JSON object; an empty body is ``{}`` unless one is ``required``
        (where Triton fails to parse an empty one)."""
        body = await self._raw_body(request.scope, request.receive)
        return convert.parse_json_object(body, what, required)

    async def live(self, request: Request) -> Response:
        return Response(status_code=200 if self.service.live() else 400)

    async def ready(self, request: Request) -> Response:
        return Response(status_code=200 if self.service.ready() else 400)

    async def server_metadata(self, request: Request) -> Response:
        return _json(convert.server_metadata_json(self.service.server_metadata()))

    async def openapi(self, request: Request) -> Response:
        if not _OPENAPI.is_file():
            raise HTTPException(404)
        return Response(_OPENAPI.read_bytes(), media_type="application/json")

    async def model_metadata(self, request: Request) -> Response:
        name, version = _model(request)
        return _json(convert.model_metadata_json(self.service.model_metadata(name, version)))

    async def model_ready(self, request: Request) -> Response:
        if self.service.model_ready(*_model(request)):
            return Response(status_code=200)
        return Response(error_body("Model version not ready"), 400, media_type="application/json")

    async def model_config(self, request: Request) -> Response:
        return _json(self.service.model_config_dict(*_model(request)))

    async def stats(self, request: Request) -> Response:
        name, version = _model(request)
        return _json(convert.statistics_json(self.service.statistics(name, version)))

    async def repository_index(self, request: Request) -> Response:
        ready = (await self._body(request, "repository index")).get("ready", False)
        if not isinstance(ready, bool):
            raise errors.InvalidArgumentError("Invalid value for 'ready': expected a boolean")
        return _json(convert.repository_index_json(self.service.repository_api.index(ready)))

    async def load(self, request: Request) -> Response:
        parameters = (await self._body(request, "load model")).get("parameters", {})
        config = None  # (null parameters are refused, as Triton refuses them)
        files: dict[str, bytes] = {}
        for key, value in _object(parameters, "parameters").items():
            if key.startswith("file:"):  # a model file, base64-encoded
                files[key] = _base64(key, value)
                continue
            if key != "config":
                raise errors.InvalidArgumentError(f"unexpected load parameter '{key}'")
            if not isinstance(value, str):
                raise errors.InvalidArgumentError("Unable to parse 'config': expected a string")
            config = value
        await self.service.repository_api.load(request.path_params["model"], config, files or None)
        return Response(status_code=200, media_type="application/json")

    async def unload(self, request: Request) -> Response:
        parameters = (await self._body(request, "unload model")).get("parameters")
        if parameters is None:  # null: none (Triton reads it so)
            parameters = {}
        dependents = _object(parameters, "parameters").get("unload_dependents", False)
        if not isinstance(dependents, bool):
            raise errors.InvalidArgumentError(
                "Unable to parse 'unload_dependents': expected a boolean"
            )
        await self.service.repository_api.unload(request.path_params["model"])
        return Response(status_code=200, media_type="application/json")

    async def logging(self, request: Request) -> Response:
        if request.method == "GET":
            return _json(dict(self.service.log_settings))
        updates = _log_updates(await self._body(request, "dynamic logging", required=True))
        return _json(self.service.update_log_settings(updates))

    async def trace_setting(self, request: Request) -> Response:
        model = request.path_params.get("model", "")
        if model and not self.service.model_ready(model):
            raise errors.InvalidArgumentError(f"Request for unknown model : {model}")
        if request.method == "POST":
            body = await self._body(request, "trace", required=True)
            self.service.trace.update(model, _trace_updates(body))
        return _json(_trace_view(self.service.trace.get(model)))


def _model(request: Request) -> tuple[str, str]:
    params = request.path_params
    return params.get("model", ""), checked_version(params.get("version", ""))


def _base64(key: str, value: object) -> bytes:
    try:
        if not isinstance(value, str):
            raise ValueError("not a string")
        return base64.b64decode(value, validate=True)
    except (ValueError, binascii.Error):
        raise errors.InvalidArgumentError(
            f"Unable to parse '{key}': expected the file's content as a base64 string"
        ) from None


def _object(value: object, what: str) -> convert.JsonObject:
    if not isinstance(value, dict):
        raise errors.InvalidArgumentError(f"Unable to parse '{what}': expected a JSON object")
    return value


_INT32_MAX: Final = 2**31 - 1
_LOG_TYPES: dict[str, type] = {
    "log_info": bool, "log_warning": bool, "log_error": bool, "log_verbose_level": int,
    "log_format": str,
}  # fmt: skip


def _log_updates(body: convert.JsonObject) -> dict[str, Any]:
    """Triton's rules: null leaves a setting as it is; the log file is not remotely set."""
    updates: dict[str, Any] = {}
    for key, value in body.items():
        if value is None:
            continue
        if key == "log_file":
            raise errors.UnsupportedError(
                "log file location can not be updated through network protocol"
            )
        expected = _LOG_TYPES.get(key)
        if expected is None:
            continue  # Triton reads only the settings it knows
        if expected is int and type(value) is float and value.is_integer():
            value = int(value)  # 3.0 is an integer in JSON
        if type(value) is not expected or (
            isinstance(value, int) and not 0 <= value <= _INT32_MAX  # gRPC's is a uint32
        ):
            raise errors.InvalidArgumentError(f"invalid value for '{key}': {value!r}")
        if key == "log_format" and value not in ("default", "ISO8601"):
            raise errors.InvalidArgumentError(f"invalid argument for --log_format, got: {value}")
        updates[key] = value
    return updates


_TRACE_KEYS: Final = ("trace_level", "trace_rate", "trace_count", "log_frequency", "trace_file",
                      "trace_mode")  # fmt: skip


def _trace_updates(body: convert.JsonObject) -> dict[str, list[str]]:
    """HTTP's trace settings body in the core's form, typed as Triton reads it: null
    clears, ``trace_level`` is a list of strings, the others strings; other keys are not
    settings (ignored, as Triton ignores them)."""
    updates: dict[str, list[str]] = {}
    for key, value in body.items():
        if key not in _TRACE_KEYS:
            continue
        if value is None:
            updates[key] = []
        elif key == "trace_level":
            if not isinstance(value, list) or not all(type(v) is str for v in value):
                raise errors.InvalidArgumentError(
                    f"Unable to parse '{key}': expected a list of strings, got: {value!r}"
                )
            updates[key] = value
        elif type(value) is str:
            updates[key] = [value]
        elif key == "trace_file":
            updates[key] = [str(value)]  # refused whatever it is (501)
        else:
            raise errors.InvalidArgumentError(
                f"Unable to parse '{key}': expected a string, got: {value!r}"
            )
    return updates


def _trace_view(settings: dict[str, list[str]]) -> dict[str, object]:
    return {k: v if k == "trace_level" else (v[0] if v else "") for k, v in settings.items()}


async def _dlserve_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, errors.DlserveError)
    status, body = error_reply(exc)
    return Response(body, status, media_type="application/json")


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return Response(error_body(exc.detail), exc.status_code, exc.headers,  # 405: Allow
                    media_type="application/json")  # fmt: skip
