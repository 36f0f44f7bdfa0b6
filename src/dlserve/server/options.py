"""The ``serve`` command's options, in the groups ``dlserve serve --help`` shows."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dlserve import __version__
from dlserve.server import triton_options
from dlserve.server.frontends.restrictions import GROUPS

DEPRECATED_TRACE = {
    "--trace-file": "triton,file", "--trace-level": "level", "--trace-rate": "rate",
    "--trace-count": "count", "--trace-log-frequency": "triton,log-frequency",
}  # fmt: skip


def _microseconds(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _flag(text: str) -> bool:
    """Triton's boolean option values."""
    if text.lower() in ("true", "1", "yes", "on"):
        return True
    if text.lower() in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dlserve",
        description="dlserve serve --model-repository DIR: serve a Triton model repository",
    )
    parser.add_argument("--version", action="version", version=f"dlserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a Triton model repository")
    serve.add_argument(  # --model-store: Triton's older spelling
        "--model-repository", "--model-store", dest="model_repository", required=True, type=Path
    )
    _endpoint_options(serve.add_argument_group("endpoints"))
    _model_options(serve.add_argument_group("models"))
    _log_options(serve.add_argument_group("logging"))
    _tuning_options(serve.add_argument_group("shared memory, latency, GPUs"))
    _tls_options(serve.add_argument_group("gRPC over TLS (Triton's options)"))
    _access_options(serve.add_argument_group("endpoint access (Triton's options)"))
    _grpc_limit_options(serve.add_argument_group("gRPC limits (docs/network-edge.md)"))
    triton_options.add_options(serve)  # hidden: answered in main(), see triton_options
    return parser


def _endpoint_options(group: Any) -> None:
    group.add_argument(
        "--host", default="127.0.0.1",
        help="the address of every endpoint, unless one of the three below is given "
        "(default 127.0.0.1)",
    )  # fmt: skip
    for endpoint, default in (
        ("grpc", "--host"),
        ("http", "--host"),
        ("metrics", "--http-address"),
    ):
        group.add_argument(
            f"--{endpoint}-address", metavar="ADDRESS",
            help=f"the {endpoint} endpoint's address (Triton's option; default: {default})",
        )  # fmt: skip
    group.add_argument("--grpc-port", type=int, default=8001)
    group.add_argument("--http-port", type=int, default=8000)
    group.add_argument("--metrics-port", type=int, default=8002)
    for endpoint in ("grpc", "http", "metrics"):
        group.add_argument(
            f"--allow-{endpoint}", type=_flag, nargs="?", const=True, default=True,
            metavar="BOOL", help=f"serve the {endpoint} endpoint (default true)",
        )  # fmt: skip
    for kind in ("cpu", "gpu"):
        group.add_argument(
            f"--allow-{kind}-metrics", type=_flag, nargs="?", const=True, default=True,
            metavar="BOOL", help=f"report Triton's {kind.upper()} metrics (default true)",
        )  # fmt: skip
    group.add_argument(
        "--grpc-uds", default=None, metavar="PATH",
        help="gRPC also listens on this Unix socket (clients use the URL 'unix:PATH')",
    )  # fmt: skip
    group.add_argument(
        "--http-max-input-size", type=int, default=64 * 1024 * 1024,
        help="largest HTTP request body accepted, in bytes (Triton's default)",
    )  # fmt: skip
    group.add_argument(
        "--strict-readiness", type=_flag, nargs="?", const=True, default=True, metavar="BOOL",
        help="ready only while every model is READY (a model that failed to load makes the "
        "server not ready); false: ready once started (default true, as Triton)",
    )  # fmt: skip
    group.add_argument(
        "--exit-timeout-secs", type=_seconds, default=30.0, metavar="SECONDS",
        help="at shutdown (and when a model is unloaded), how long in-flight requests, "
        "streams included, may take to finish before they are ended and their workers "
        "stopped anyway (default 30, as Triton)",
    )  # fmt: skip
    group.add_argument(
        "--id", default="dlserve", metavar="NAME",
        help="the server's name in its metadata (Triton's option; default dlserve)",
    )  # fmt: skip
    group.add_argument(
        "--ready-fd", type=int, default=None,
        help="write the bound ports as a JSON line to this fd once ready",
    )  # fmt: skip


def _model_options(group: Any) -> None:
    group.add_argument(
        "--model-control-mode", choices=("none", "explicit", "poll"), default="none",
        help="none: load every model at startup; explicit: load and unload through the "
        "repository API; poll: follow the repository's changes",
    )  # fmt: skip
    group.add_argument(
        "--load-model", action="append", default=[], metavar="NAME",
        help="explicit mode: load this model at startup ('*' for all)",
    )  # fmt: skip
    group.add_argument(
        "--repository-poll-secs", type=_seconds, default=15.0, metavar="SECONDS",
        help="poll mode: how often the repository is looked at (default 15)",
    )  # fmt: skip
    group.add_argument(
        "--model-config-name", default="", metavar="NAME",
        help="load each model's configs/NAME.pbtxt where it has one, instead of its "
        "config.pbtxt (Triton's option)",
    )  # fmt: skip
    group.add_argument(
        "--exit-on-error", type=_flag, nargs="?", const=True, default=True, metavar="BOOL",
        help="true: stop (exit status 1) when a model fails to load at startup, as Triton "
        "does; false: serve the others, the failed ones UNAVAILABLE (default true)",
    )  # fmt: skip
    group.add_argument(
        "--disable-auto-complete-config", action="store_true",
        help="do not call the models' auto_complete_config: configs must be complete",
    )  # fmt: skip
    group.add_argument(
        "--strict-model-config", type=_flag, nargs="?", const=True, default=False,
        metavar="BOOL", help="true: the same as --disable-auto-complete-config (Triton's "
        "older spelling; default false)",
    )  # fmt: skip
    group.add_argument(
        "--cache-config", action="append", default=[], metavar="local,size=BYTES",
        help="the response cache (Triton's syntax, <cache>,<setting>=<value>): 'local', an "
        "LRU of responses in memory of at most BYTES, for models that enable response_cache",
    )  # fmt: skip
    group.add_argument(
        "--response-cache-byte-size", type=int, default=None, metavar="BYTES",
        help="deprecated (as in Triton): the same as --cache-config local,size=BYTES",
    )  # fmt: skip
    group.add_argument(
        "--debug", action="store_true",
        help="run model instances as threads of the server (for debugging)",
    )  # fmt: skip


def _log_options(group: Any) -> None:
    group.add_argument("--log-verbose", type=int, default=0)
    for level in ("info", "warning", "error"):
        group.add_argument(
            f"--log-{level}", type=_flag, nargs="?", const=True, default=True, metavar="BOOL",
            help=f"log {level} messages, the server's and the models' (default true)",
        )  # fmt: skip
    group.add_argument(
        "--log-format", choices=("default", "ISO8601"), default="default",
        help="the log lines' timestamps: local time, or ISO 8601 in UTC (default: default)",
    )  # fmt: skip
    group.add_argument(
        "--log-file", metavar="PATH",
        help="append the server's and the models' log lines (their stderr) to this file",
    )  # fmt: skip
    group.add_argument(
        "--trace-config", action="append", default=[], metavar="[triton,]SETTING=VALUE",
        help="Triton's request tracing: level=OFF|TIMESTAMPS|TENSORS (repeatable), rate=N "
        "(every N-th request), count=N (-1: no limit), mode=triton, triton,file=PATH, "
        "triton,log-frequency=N (write every N traces to PATH.<n>); repeatable",
    )  # fmt: skip
    for name, setting in DEPRECATED_TRACE.items():  # Triton's older spellings
        group.add_argument(
            name, action="append", default=[], metavar="VALUE",
            help=f"deprecated (as in Triton): --trace-config {setting}=VALUE",
        )  # fmt: skip


def _tuning_options(group: Any) -> None:
    group.add_argument(
        "--allow-client-shm", choices=("local", "false", "any"), default="local",
        help="who may register client shared memory: local peers only (loopback or a Unix "
        "socket), nobody, or anyone",
    )  # fmt: skip
    group.add_argument(
        "--shm-idle-timeout", type=float, default=None, metavar="SECONDS",
        help="unregister client shared memory regions no request has used for this long",
    )  # fmt: skip
    group.add_argument(
        "--busy-poll-us", type=_microseconds, default=0, metavar="US",
        help="trade CPU for latency: a worker polls this long for its next request before "
        "sleeping, and the server polls while requests are in flight (0: off)",
    )  # fmt: skip
    group.add_argument(
        "--reply-poll-us", type=_microseconds, metavar="US",
        help="after it sends a request to a worker, the server polls this long for the reply "
        "before it sleeps, yielding the CPU to anyone runnable (default 2000; 0: off)",
    )  # fmt: skip
    group.add_argument(
        "--bls-direct", type=_flag, default=True, metavar="BOOL",
        help="BLS calls to plain models go from the caller's worker straight to the callee's, "
        "not through the server (false: every call through the server)",
    )  # fmt: skip
    group.add_argument(
        "--mps", action="store_true",
        help="start a private NVIDIA MPS daemon for the workers, so their GPU work shares "
        "one context instead of the GPU switching between processes (docs/pitfalls.md)",
    )  # fmt: skip


def _tls_options(group: Any) -> None:
    group.add_argument("--grpc-use-ssl", type=_flag, nargs="?", const=True, default=False,
                       metavar="BOOL", help="serve gRPC over TLS")  # fmt: skip
    group.add_argument(
        "--grpc-use-ssl-mutual", type=_flag, nargs="?", const=True, default=False,
        metavar="BOOL", help="and require clients' certificates (implies --grpc-use-ssl)",
    )  # fmt: skip
    group.add_argument("--grpc-server-cert", metavar="FILE", help="the server's certificate (PEM)")
    group.add_argument("--grpc-server-key", metavar="FILE", help="its private key (PEM)")
    group.add_argument("--grpc-root-cert", metavar="FILE",
                       help="mutual TLS: the certificate clients' must chain to (PEM)")  # fmt: skip


def _access_options(group: Any) -> None:
    groups = ", ".join(GROUPS)
    group.add_argument(
        "--grpc-restricted-protocol", action="append", default=[],
        metavar="GROUPS:KEY=VALUE",
        help="only calls with the header 'triton-grpc-protocol-KEY: VALUE' may use these "
        f"groups of RPCs (repeatable; a group in one option only). Groups: {groups}",
    )  # fmt: skip
    group.add_argument(
        "--http-restricted-api", action="append", default=[],
        metavar="GROUPS:KEY=VALUE",
        help="only requests with the header 'KEY: VALUE' may use these groups of "
        f"routes (repeatable; a group in one option only). Groups: {groups}",
    )  # fmt: skip


# -- gRPC limits: what one peer may make the server hold (transport/grpc/limits.py) -------
def _byte_count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _grpc_limit_options(group: Any) -> None:
    from dlserve.server.transport.grpc import limits

    group.add_argument(
        "--grpc-max-message-size", type=_byte_count, default=limits.MAX_MESSAGE,
        metavar="BYTES", help="largest gRPC request message accepted as received; larger "
        f"is RESOURCE_EXHAUSTED (default {limits.MAX_MESSAGE}, Triton's)",
    )  # fmt: skip
    group.add_argument(
        "--grpc-max-decompressed-size", type=_byte_count, default=limits.MAX_INFLATED,
        metavar="BYTES", help="largest a gzip or deflate request message may inflate to; "
        f"larger is RESOURCE_EXHAUSTED (default {limits.MAX_INFLATED})",
    )  # fmt: skip
    group.add_argument(
        "--grpc-infer-max-fields", type=_byte_count, default=4096, metavar="COUNT",
        help="most top-level fields a ModelInferRequest may have (its inputs, outputs, raw "
        "contents and parameters together); more is INVALID_ARGUMENT (default 4096)",
    )  # fmt: skip
    group.add_argument(
        "--grpc-connection-send-budget", type=_byte_count, default=limits.SEND_BUDGET,
        metavar="BYTES", help="responses one connection may leave unsent before its further "
        f"calls wait (default {limits.SEND_BUDGET})",
    )  # fmt: skip
    group.add_argument(
        "--grpc-send-timeout", type=_seconds, default=limits.SEND_TIMEOUT_S,
        metavar="SECONDS", help="a connection whose responses wait while nothing moves for "
        f"this long is closed and its calls cancelled (default {limits.SEND_TIMEOUT_S:g})",
    )  # fmt: skip
