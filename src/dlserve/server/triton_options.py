"""Triton's server options that dlserve has no part for, so that a Triton command line is
met with an answer for each of them instead of argparse's "unrecognized arguments".

- **Tuning** options size or place parts of Triton's own machinery (memory pools, thread
  counts, where its backends are): dlserve has no such part, and what a client or a model
  sees is the same without them. They are accepted, and each one given is named in a
  warning at start.
- **Feature** options ask for behaviour dlserve does not have. They are refused with the
  reason (exit status 2), all of them in one message: a server that silently behaves
  otherwise than its command line asks would hide the difference.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Final


@dataclass(frozen=True, slots=True)
class Unsupported:
    tuning: bool  # True: accepted with a warning; False: refused
    reason: str


_TUNING: Final = {
    "--pinned-memory-pool-byte-size": "Triton's pool of page-locked host memory (dlserve "
    "page-locks its arenas and client regions itself, as a copy needs them)",
    "--cuda-memory-pool-byte-size": "Triton's pool of GPU memory for copies (dlserve's GPU "
    "tensors stay where the client or the model put them)",
    "--cuda-virtual-address-size": "the address space of Triton's GPU memory pools",
    "--buffer-manager-thread-count": "Triton's threads for moving input and output buffers",
    "--model-load-thread-count": "Triton's threads for loading models (dlserve loads the "
    "models at startup concurrently, on its event loop)",
    "--http-thread-count": "Triton's HTTP server threads (dlserve's HTTP server runs on its "
    "event loop)",
    "--grpc-infer-allocation-pool-size": "Triton's pool of gRPC response messages",
    "--backend-directory": "where Triton finds its backends (dlserve's Python backend is built in)",
    "--repoagent-directory": "where Triton finds its repository agents",
    "--metrics-interval-ms": "how often Triton samples its metrics (dlserve reads them when "
    "they are scraped)",
    "--backend-config": "settings of Triton's backends (the Python backend's "
    "shm-default-byte-size, shm-growth-byte-size, stub-timeout-seconds, ...: dlserve's "
    "workers have no stub and no shared-memory pool of that kind)",
}

_FEATURES: Final = {
    "--rate-limit": "Triton's rate limiter (each dlserve instance runs one execute at a "
    "time; requests wait in the model's queue)",
    "--rate-limit-resource": "Triton's rate limiter's resources",
    "--host-policy": "NUMA host policies",
    "--model-namespacing": "model namespacing (model names are unique across the repository)",
    "--model-load-retry-count": "retrying a model load that failed",
    "--model-load-gpu-limit": "a GPU memory limit on model loading",
    "--enable-peer-access": "switching CUDA peer access between GPUs",
    "--min-supported-compute-capability": "refusing GPUs below a compute capability",
    "--http-header-forward-pattern": "forwarding HTTP headers to the model as parameters",
    "--grpc-header-forward-pattern": "forwarding gRPC metadata to the model as parameters",
    "--grpc-infer-response-compression-level": "compressing gRPC responses (requests "
    "compressed by the client are accepted)",
    "--grpc-max-connection-age": "closing gRPC connections after an age",
    "--grpc-max-connection-age-grace": "closing gRPC connections after an age",
    "--reuse-http-port": "sharing the HTTP port with other processes (SO_REUSEPORT)",
    "--reuse-grpc-port": "sharing the gRPC port with other processes (SO_REUSEPORT)",
    "--metrics-config": "Triton's metrics settings (summaries, latency histograms)",
    "--cache-directory": "caches implemented as shared libraries (the 'local' cache is built in)",
    "--allow-sagemaker": "the SageMaker endpoint",
    "--sagemaker-port": "the SageMaker endpoint",
    "--sagemaker-safe-port-range": "the SageMaker endpoint",
    "--sagemaker-thread-count": "the SageMaker endpoint",
    "--allow-vertex-ai": "the Vertex AI endpoint",
    "--vertex-ai-port": "the Vertex AI endpoint",
    "--vertex-ai-thread-count": "the Vertex AI endpoint",
    "--vertex-ai-default-model": "the Vertex AI endpoint",
}

UNSUPPORTED: Final = {name: Unsupported(True, reason) for name, reason in _TUNING.items()} | {
    name: Unsupported(False, reason) for name, reason in _FEATURES.items()
}


_GLOBAL_BACKEND_SETTING: Final = (
    "a setting for every backend (such as default-max-batch-size, the max_batch_size "
    "Triton's auto-complete gives models that support batching): dlserve applies none; "
    "set it in the models' configs"
)


def _is_global(value: str) -> bool:
    """``--backend-config=<setting>=<value>``: no backend named before a comma."""
    name, _, _ = value.partition("=")
    return "," not in name


def add_options(group: Any) -> None:
    """Each option takes a value (as all of Triton's do) and may be repeated."""
    for name in UNSUPPORTED:
        group.add_argument(name, action="append", default=[], metavar="VALUE",
                           help=argparse.SUPPRESS)  # fmt: skip


def _given(args: argparse.Namespace) -> list[str]:
    return [name for name in UNSUPPORTED if getattr(args, name[2:].replace("-", "_"))]


def check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The warnings for the tuning options given; a usage error naming every feature
    option given, with its reason."""
    given = _given(args)
    refused = [f"{name}: {UNSUPPORTED[name].reason}" for name in given
               if not UNSUPPORTED[name].tuning]  # fmt: skip
    refused += [f"--backend-config={value}: {_GLOBAL_BACKEND_SETTING}"
                for value in args.backend_config if _is_global(value)]  # fmt: skip
    if refused:
        parser.error("dlserve does not do what these Triton options ask for: "
                     + "; ".join(refused))  # fmt: skip
    return [
        f"Warning: {name} has no effect in dlserve: it tunes {UNSUPPORTED[name].reason}"
        for name in given
    ]
