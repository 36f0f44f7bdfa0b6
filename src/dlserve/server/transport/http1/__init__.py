"""HTTP/1.1 (RFC 9112) on httptools, for ASGI apps."""
