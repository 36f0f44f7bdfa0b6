"""Triton's protocols translated to and from the core's types."""
