"""A package beside model.py, which imports it relatively."""

from .scaling import scale

__all__ = ["scale"]
