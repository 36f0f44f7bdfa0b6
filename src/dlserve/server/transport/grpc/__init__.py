"""gRPC over HTTP/2: calls, messages, status, deadlines, listening."""
