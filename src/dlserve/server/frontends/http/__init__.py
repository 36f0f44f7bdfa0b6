"""Triton's HTTP/REST API (KServe v2 + Triton's extensions)."""
