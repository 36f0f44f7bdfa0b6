"""What one gRPC peer may make the server hold, and for how long: the limits a
:class:`~dlserve.server.transport.grpc.listener.GrpcServer` applies to its calls.

- ``max_message``: a request message as received (its 5-byte prefix's length); larger is
  RESOURCE_EXHAUSTED "Received message larger than max (X vs. Y)", as grpc core says it.
  The default is protobuf's own limit, what Triton's server accepts.
- ``max_inflated``: a compressed message (gzip, deflate) once inflated. It is inflated in
  slices and refused with the same status as soon as it passes this, so a few MiB that
  would inflate to gigabytes cost at most this much, and the event loop runs between
  slices.
- ``send_budget``: what one connection may make the server hold produced and not yet
  sent (responses waiting for the client's flow-control window or in the socket's
  buffer). Past it the connection's further calls, and a stream's further requests, wait
  before they run (``budget.py``).
- ``send_timeout``: how long a connection's responses may wait while nothing moves; then
  it is closed, its calls cancelled and what it held released.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

MAX_MESSAGE: Final = 2**31 - 1  # protobuf's own limit, Triton's gRPC receive limit
MAX_INFLATED: Final = 256 * 2**20
SEND_BUDGET: Final = 64 * 2**20
SEND_TIMEOUT_S: Final = 30.0


@dataclass(frozen=True, slots=True)
class GrpcLimits:
    max_message: int = MAX_MESSAGE  # --grpc-max-message-size
    max_inflated: int = MAX_INFLATED  # --grpc-max-decompressed-size
    send_budget: int = SEND_BUDGET  # --grpc-connection-send-budget
    send_timeout: float = SEND_TIMEOUT_S  # --grpc-send-timeout


DEFAULT_LIMITS: Final = GrpcLimits()
