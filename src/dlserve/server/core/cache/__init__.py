"""Triton's response cache."""
