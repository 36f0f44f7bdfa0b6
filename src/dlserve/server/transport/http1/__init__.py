"""HTTP/1.1 (RFC 9112) on httptools, for ASGI apps: ``listener.py`` (listening, graceful
stop), ``connection.py`` (one connection: parsing, pipelining, flow control) and
``exchange.py`` (one request and its response: ASGI's receive and send)."""
