"""The protocol machinery of the server's endpoints, readable and testable as protocol
implementations: it imports nothing of dlserve's domain (``scripts/check_layers.py``
holds it to that). What is the server's own is passed in by the frontends: the gRPC
method table with its handlers and header guards (Triton's restricted endpoints), how a
handler's failure becomes a gRPC status (Triton's error codes), the ASGI app, whether
tracing wants arrival times.

- ``h2/``: HTTP/2 (RFC 9113) and HPACK (RFC 7541), server side: frames, one connection's
  state machine and its sending side. Driven by bytes in, writing bytes out: no socket
  needed to run it.
- ``grpc/``: gRPC over that HTTP/2: calls, messages, status, deadlines, a streaming
  call's bounded outbox, and the listener (TCP, TLS, a Unix socket, graceful stop).
- ``http1/``: HTTP/1.1 (RFC 9112) on httptools for an ASGI app, and its listener.
- ``turns.py``: how long one client's work may hold the event loop at a time;
  ``timing.py``: what the transports ask of tracing; ``listen_error.py``: the error of a
  listener that cannot start.
"""
