"""Triton's gRPC service (KServe v2 + Triton's extensions)."""
