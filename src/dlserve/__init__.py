"""dlserve: a Triton-compatible inference server for Python models, with zero-copy tensors.

Run it with ``dlserve serve --model-repository DIR``; talk to it with tritonclient.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
