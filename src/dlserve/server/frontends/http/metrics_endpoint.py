"""The Prometheus endpoint: ``GET /metrics`` on the metrics port."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from dlserve.server.core.service import InferenceService
from dlserve.server.core.telemetry.metrics import CONTENT_TYPE

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def create_metrics_app(
    service: InferenceService,
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            status, body, ctype = 200, service.metrics.render(), CONTENT_TYPE
        else:
            status, body, ctype = 404, b"not found\n", "text/plain"
        headers = [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app
