"""HTTP/2 (RFC 9113) and HPACK (RFC 7541), server side."""
