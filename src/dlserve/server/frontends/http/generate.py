"""Triton's generate extension: ``POST /v2/models/{model}[/versions/{version}]/generate``
and ``.../generate_stream``.

The request is one flat JSON object. A key that names one of the model's inputs is that
input: a scalar or a flat list, its datatype the model's, its shape the model's dims with
the elements spread over them (the fixed dims first; then the innermost -1 takes what is
left and any other -1 is 1). Any other key is a request parameter (a string, a number or
a boolean), and so is each key of an optional ``"parameters"`` object, by the same rule.

The response is one flat JSON object: ``model_name``, ``model_version``, the response's
parameters, and each output as the list of its elements (one element: the element
itself); where names clash, the first of these wins, as in Triton.

``/generate`` answers once, so a decoupled model must send exactly one response.
``/generate_stream`` answers with server-sent events, a ``data:`` event per response and
an ``{"error": ...}`` event per failed one; its status is that of the first response. A
request that is refused (before inference: an unknown model, a bad body, inputs that do
not fit the model) gets a JSON error, as every other route and as Triton answers it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from dlserve import errors
from dlserve.server.core.service import InferenceService
from dlserve.server.core.telemetry.tracer import Trace
from dlserve.server.frontends.http import convert
from dlserve.server.frontends.http.status_codes import error_body, error_reply
from dlserve.server.frontends.requests import checked_version, of_inference
from dlserve.server.transport.http1.exchange import CANCEL_ON_CLOSE, RECEIVED_NS
from dlserve.types import InferRequest, InferResponse, InputTensor, Parameters, TensorMetadata

log = logging.getLogger("dlserve.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ReadBody = Callable[[Scope, Receive], Awaitable[bytes | bytearray | memoryview]]

_JSON = (b"content-type", b"application/json")
_EVENTS = (b"content-type", b"text/event-stream; charset=utf-8")
FAILED = 400  # Triton's status for a request whose inference failed
ONE_RESPONSE = (
    "generate expects model to produce exactly 1 response, use generate stream for model "
    "that generates various number of responses"
)


# --- request ------------------------------------------------------------------------------


def parse_generate_request(
    body: convert.JsonObject, model: str, version: str, inputs: tuple[TensorMetadata, ...]
) -> InferRequest:
    """The core request a generate body describes (see the module's docstring)."""
    by_name = {tensor.name: tensor for tensor in inputs}
    tensors: list[InputTensor] = []
    parameters: Parameters = {}

    def take(key: str, value: object) -> None:
        meta = by_name.get(key)
        if meta is None:
            parameters[key] = _parameter(key, value)
        else:
            tensors.append(_tensor(meta, value))

    for key, value in body.items():
        if key == "parameters" and key not in by_name:
            if not isinstance(value, dict):
                raise errors.InvalidArgumentError("Expected JSON object for keyword: 'parameters'")
            for inner, item in value.items():
                take(inner, item)
        else:
            take(key, value)
    return InferRequest(model, version, "", tensors, [], parameters)


def _parameter(key: str, value: object) -> bool | int | float | str:
    if isinstance(value, bool | int | float | str):
        return value
    raise errors.InvalidArgumentError(
        f"generate request key '{key}' is neither an input of the model nor a parameter "
        f"(a string, a number or a boolean): got {type(value).__name__}"
    )


def _tensor(meta: TensorMetadata, value: object) -> InputTensor:
    data = value if isinstance(value, list) else [value]
    if any(isinstance(item, list | dict) for item in data):
        raise errors.InvalidArgumentError(
            f"generate input '{meta.name}' must be a scalar or a flat list"
        )
    shape = spread(meta.name, len(data), meta.shape)
    raw = convert.json_to_tensor_bytes(meta.name, meta.datatype, shape, data)
    return InputTensor(meta.name, meta.datatype, shape, raw)


def spread(name: str, count: int, dims: tuple[int, ...]) -> tuple[int, ...]:
    """``count`` elements as a shape of ``dims``: the fixed dims must divide them, the
    innermost -1 takes what is left, any other -1 is 1."""
    fixed = math.prod(d for d in dims if d >= 0)
    free = [i for i, d in enumerate(dims) if d < 0]
    if free and fixed:
        fits, left = count % fixed == 0, count // fixed
    else:  # nothing to spread over, or a zero dim: only an exact count fits
        fits, left = count == fixed, 0
    if not fits:
        raise errors.InvalidArgumentError(
            f"The schema can not convert input '{name}' to tensor with proper shape: "
            f"{count} elements for dims {list(dims)}"
        )
    innermost = free[-1] if free else -1
    return tuple(left if i == innermost else (1 if d < 0 else d) for i, d in enumerate(dims))


# --- response -----------------------------------------------------------------------------


def generate_response_json(response: InferResponse) -> convert.JsonObject:
    """One response as the generate extension's flat object."""
    out: convert.JsonObject = {}
    if response.id:
        out["id"] = response.id
    out["model_name"] = response.model_name
    out["model_version"] = response.model_version
    for key, value in response.parameters.items():  # a name taken already keeps its value
        out.setdefault(key, value)
    for output in response.outputs:
        if output.name in out:
            continue
        if output.data is None:
            raise errors.InternalError(f"output '{output.name}' has no data to put in JSON")
        values = convert.tensor_bytes_to_json(output.datatype, output.data)
        if values is None:
            raise errors.UnsupportedError(
                f"output '{output.name}' of type {output.datatype} cannot be written as JSON"
            )
        out[output.name] = values[0] if len(values) == 1 else values
    return out


def _event(value: convert.JsonObject) -> bytes:
    return b"data: " + convert.encode_json(value) + b"\n\n"


# --- the endpoints ------------------------------------------------------------------------


class GenerateEndpoint:
    """``.../generate`` (``streaming`` False) or ``.../generate_stream`` as an ASGI app."""

    def __init__(self, service: InferenceService, read_body: ReadBody, streaming: bool) -> None:
        self.service = service
        self.read_body = read_body
        self.streaming = streaming

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        params = scope["path_params"]
        model, version = params["model"], params.get("version", "")
        scope[CANCEL_ON_CLOSE] = True  # a client that goes away stops its request
        received = scope.get(RECEIVED_NS)  # there while tracing is on
        trace = _sample(self.service, model, received) if received is not None else None
        try:
            await self._answer(model, version, scope, receive, send, trace)
        finally:
            if trace is not None:
                trace.release()

    async def _answer(
        self, model: str, version: str, scope: Scope, receive: Receive, send: Send,
        trace: Trace | None,
    ) -> None:  # fmt: skip
        try:
            try:
                request = await self._request(model, version, scope, receive, trace)
            except errors.DlserveError as exc:  # before inference: the usual status
                status, body = error_reply(exc)
            else:
                if self.streaming:
                    await self._stream(request, send, trace)
                    return
                try:
                    answer = await self._once(request, trace)
                    status, body = 200, convert.encode_json(answer)
                except errors.DlserveError as exc:  # inference failed: 400, as Triton
                    status, body = FAILED, error_body(exc.message)
        except Exception as exc:  # a bug: answer, log, keep serving
            log.exception("generate on model '%s' failed", model)
            status, body = 500, error_body(f"internal error: {exc!r}")
        if trace is not None:
            trace.stamp("HTTP_SEND_START", time.monotonic_ns())
        await _reply(send, status, body)
        if trace is not None:
            trace.stamp("HTTP_SEND_END", time.monotonic_ns())

    async def _request(
        self, model: str, version: str, scope: Scope, receive: Receive, trace: Trace | None
    ) -> InferRequest:
        for name, value in scope["headers"]:
            if name == b"content-encoding" and value.lower() not in (b"", b"identity"):
                raise errors.InvalidArgumentError(
                    "Unsupported content-encoding, only 'identity' is supported."
                )
        version = checked_version(version)
        inputs = self.service.model_metadata(model, version).inputs
        raw = await self.read_body(scope, receive)
        if trace is not None:
            trace.stamp("HTTP_RECV_END", time.monotonic_ns())
        body = convert.parse_json_object(raw, "generate", required=True)
        return parse_generate_request(body, model, version, inputs)

    async def _once(self, request: InferRequest, trace: Trace | None) -> convert.JsonObject:
        """The one response of the request (a decoupled model's, too)."""
        responses: list[InferResponse] = []
        items = self.service.infer_stream(request, trace=trace)
        async with contextlib.aclosing(items):
            async for item in items:
                if item.error is not None:
                    raise item.error
                if item.response is not None:
                    responses.append(item.response)
        if len(responses) != 1:
            raise errors.InternalError(ONE_RESPONSE)
        if trace is not None:
            trace.stamp("INFER_RESPONSE_COMPLETE", time.monotonic_ns())
        return generate_response_json(responses[0])

    async def _stream(self, request: InferRequest, send: Send, trace: Trace | None) -> None:
        """One event per response; the status is the first response's."""
        started = False

        async def event(value: convert.JsonObject, status: int) -> None:
            nonlocal started
            if trace is not None:
                trace.stamp("INFER_RESPONSE_COMPLETE", time.monotonic_ns())
                trace.stamp("HTTP_SEND_START", time.monotonic_ns())
            if not started:
                started = True
                start = {"type": "http.response.start", "status": status,
                         "headers": [_EVENTS]}  # fmt: skip
                await send(start)
            await send({"type": "http.response.body", "body": _event(value),
                        "more_body": True})  # fmt: skip
            if trace is not None:
                trace.stamp("HTTP_SEND_END", time.monotonic_ns())

        try:
            items = self.service.infer_stream(request, trace=trace)
            async with contextlib.aclosing(items):
                async for item in items:
                    if item.error is not None and not started and not of_inference(item.error):
                        await _reply(send, *error_reply(item.error))  # refused: no stream
                        return
                    if item.error is not None:
                        await event({"error": item.error.message}, FAILED)
                    elif item.response is not None:
                        try:
                            body = generate_response_json(item.response)
                        except errors.DlserveError as exc:
                            await event({"error": exc.message}, FAILED)
                        else:
                            await event(body, 200)
                    # else: a bare final flag, nothing to send
        except Exception as exc:  # a bug: the stream ends with it, the server goes on
            log.exception("generate_stream on model '%s' failed", request.model_name)
            await event({"error": f"internal error: {exc!r}"}, 500)
        if not started:  # no response at all
            await send({"type": "http.response.start", "status": 200, "headers": [_EVENTS]})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _sample(service: InferenceService, model: str, received: int) -> Trace | None:
    """The request's trace when its model's setting samples it."""
    trace = service.tracer.sample(model)
    if trace is not None:
        trace.stamp("HTTP_RECV_START", received)
    return trace


async def _reply(send: Send, status: int, body: bytes) -> None:
    headers = [_JSON, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
