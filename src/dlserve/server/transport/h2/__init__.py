"""HTTP/2 (RFC 9113) and HPACK (RFC 7541), server side: ``frames.py`` (types, flags,
limits, a stream's state), ``hpack_codec.py`` (header blocks), ``connection.py`` (one
connection's state machine: frames in, flow control, stream callbacks) and ``sending.py``
(what it sends, within the client's windows). Nothing here touches a socket."""
