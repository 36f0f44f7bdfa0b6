"""ErrorCode -> HTTP status: the one table, and the error body ``{"error": "<message>"}``.

The statuses are Triton's (``HttpCodeFromError`` in triton-inference-server/server
``src/http_server.cc``), so that clients which match on them keep working:

=================  ======  =====================================================
ErrorCode          status  why
=================  ======  =====================================================
INTERNAL           500     Triton: EVHTP_RES_SERVERR
NOT_FOUND          404     Triton: EVHTP_RES_NOTFOUND
UNAVAILABLE        503     Triton: EVHTP_RES_SERVUNAVAIL
UNSUPPORTED        501     Triton: EVHTP_RES_NOTIMPL
INVALID_ARG        400     Triton: EVHTP_RES_BADREQ
UNKNOWN            400     Triton: "no direct matching code" -> EVHTP_RES_BADREQ
ALREADY_EXISTS     400     Triton: 400, not 409 (a client sees what Triton sends)
CANCELLED          400     Triton: 400, not nginx's 499 (same reason)
DEADLINE_EXCEEDED  503     Triton has no such code: its timed-out requests fail
                           with UNAVAILABLE ("Request timeout expired") -> 503
=================  ======  =====================================================
"""

from __future__ import annotations

from typing import Final

import msgspec

from dlserve.errors import DlserveError, ErrorCode

HTTP_STATUS: Final[dict[ErrorCode, int]] = {
    ErrorCode.INTERNAL: 500,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.UNSUPPORTED: 501,
    ErrorCode.INVALID_ARG: 400,
    ErrorCode.UNKNOWN: 400,
    ErrorCode.ALREADY_EXISTS: 400,
    ErrorCode.CANCELLED: 400,
    ErrorCode.DEADLINE_EXCEEDED: 503,
}

_encode = msgspec.json.Encoder().encode


def http_status(code: ErrorCode) -> int:
    return HTTP_STATUS[code]


def error_body(message: str) -> bytes:
    """Triton's error JSON: ``{"error": "<message>"}``."""
    return _encode({"error": message})


def error_reply(exc: DlserveError) -> tuple[int, bytes]:
    """The status and body that answer a failed request."""
    return HTTP_STATUS[exc.code], error_body(exc.message)
