"""The ``serve`` command's options, in the groups ``dlserve serve --help`` shows."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Final

from dlserve import __version__
from dlserve.server import triton_options
from dlserve.server.frontends.restrictions import GROUPS
from dlserve.server.transport.h2.limits import Limits

DEPRECATED_TRACE = {
    "--trace-file": "triton,file", "--trace-level": "level", "--trace-rate": "rate",
    "--trace-count": "count", "--trace-log-frequency": "triton,log-frequency",
}  # fmt: skip


def _timeout(text: str) -> float | None:
    """Seconds; 0 turns the timeout off."""
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError("must be >= 0 (0: off)")
    return value or None


def _count(text: str) -> int | None:
    """A maximum; 0 turns it off."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0 (0: no limit)")
    return value or None


def _connection_limits(group: Any) -> None:
    """What one client may hold of the server (docs/network-edge.md); Triton has none."""
    for endpoint in ("http", "grpc"):
        group.add_argument(
            f"--{endpoint}-max-connections", type=_count, default=4096, metavar="N",
            help=f"{endpoint} connections open at once; more are refused (default 4096, 0: no "
            "limit)",
        )  # fmt: skip
    for name, default, what in (
        ("header", 30.0, "a request's head must arrive within this of its first byte (or of "
         "the connection's start), else 408 and close"),
        ("body", 30.0, "each window this long while a request body is read must bring "
         "--http-body-min-rate bytes a second, else 408 and close"),
        ("idle", 300.0, "a keep-alive connection idle this long between requests is closed"),
        ("send", 60.0, "a client that reads nothing of its response for this long (the "
         "server's send buffer full) is disconnected"),
    ):  # fmt: skip
        group.add_argument(
            f"--http-{name}-timeout", type=_timeout, default=default, metavar="SECONDS",
            help=f"{what} (default {default:g}, 0: off)",
        )  # fmt: skip
    group.add_argument(
        "--http-body-min-rate", type=_microseconds, default=1024, metavar="BYTES",
        help="the slowest a request body may arrive, in bytes a second (default 1024)",
    )  # fmt: skip


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
    _connection_limits(serve.add_argument_group("connection limits and timeouts"))
    _http2_options(serve.add_argument_group("gRPC's HTTP/2: keepalive (Triton's options), limits"))
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
        help="after it sends a request to a worker, the server polls this long (for the reply "
        "and for clients' next requests) before it sleeps, yielding the CPU to anyone "
        "runnable (default 2000; 0: off)",
    )  # fmt: skip
    group.add_argument(
        "--request-poll-us", type=_microseconds, metavar="US",
        help="a worker polls this long for its next request before it sleeps, yielding the "
        "CPU to anyone runnable (default 2000; 0: off)",
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


def _http2_options(group: Any) -> None:
    """gRPC's HTTP/2 connections (docs/network-edge.md): Triton's keepalive options with
    Triton's defaults, and dlserve's limits on what one connection may ask."""
    defaults = Limits()
    for flag, field_name, unit, text in _HTTP2_OPTIONS:
        default = getattr(defaults, field_name)
        kind = _flag if isinstance(default, bool) else _ranged(flag)
        group.add_argument(
            flag, dest=f"h2_{field_name}", type=kind, default=default, metavar=unit,
            help=f"{text} (default {default})",
        )  # fmt: skip


_HTTP2_OPTIONS: Final = (
    ("--grpc-keepalive-time", "keepalive_time_ms", "MS",
     "the server PINGs a connection with calls this often"),
    ("--grpc-keepalive-timeout", "keepalive_timeout_ms", "MS",
     "and closes it when the PING's ACK does not come within this"),
    ("--grpc-keepalive-permit-without-calls", "keepalive_permit_without_calls", "BOOL",
     "keepalive PINGs both ways also on connections without calls"),
    ("--grpc-http2-max-pings-without-data", "max_pings_without_data", "N",
     "keepalive PINGs the server sends with no data between (0: no limit)"),
    ("--grpc-http2-min-recv-ping-interval-without-data", "min_recv_ping_interval_without_data_ms",
     "MS", "a client PING sooner than this after its last, with no data between, is a strike"),
    ("--grpc-http2-max-ping-strikes", "max_ping_strikes", "N",
     "strikes past this: GOAWAY ENHANCE_YOUR_CALM 'too_many_pings' (0: no limit)"),
    ("--grpc-http2-max-concurrent-streams", "max_concurrent_streams", "N",
     "streams (calls) one connection may have open; more are refused (REFUSED_STREAM)"),
    ("--grpc-http2-max-header-list-size", "max_header_list_size", "BYTES",
     "a request's headers (RFC 9113 sizes); larger: RESOURCE_EXHAUSTED"),
    ("--grpc-http2-max-frame-size", "max_frame_size", "BYTES",
     "the largest frame a client may send (16384 to 16777215)"),
    ("--grpc-http2-max-resets-per-second", "max_resets_per_s", "N",
     "streams a connection may reset (or have reset) a second; more: GOAWAY (0: no limit)"),
    ("--grpc-http2-max-control-frames-per-second", "max_control_frames_per_s", "N",
     "SETTINGS, PING, PRIORITY, empty and unknown frames a second (0: no limit)"),
    ("--grpc-max-connection-idle", "max_connection_idle_ms", "MS",
     "a connection with no call open this long is closed with GOAWAY (0: never)"),
)  # fmt: skip


def _ranged(flag: str) -> Any:
    def parse(text: str) -> int:
        value = int(text)
        low, high = _HTTP2_RANGES.get(flag, (0, 2**31 - 1))
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{flag} must be from {low} to {high}")
        return value

    return parse


_HTTP2_RANGES: Final = {
    "--grpc-http2-max-frame-size": (2**14, 2**24 - 1),
    "--grpc-http2-max-concurrent-streams": (1, 2**31 - 1),
    "--grpc-http2-max-header-list-size": (1024, 2**31 - 1),
    "--grpc-keepalive-time": (0, 2**31 - 1),
    "--grpc-keepalive-timeout": (1, 2**31 - 1),
}


def http2_limits(args: argparse.Namespace) -> Limits:
    """The ``Limits`` the HTTP/2 options above give."""
    return Limits(**{name: getattr(args, f"h2_{name}") for _, name, _, _ in _HTTP2_OPTIONS})


# -- gRPC limits: what one peer may make the server hold (transport/grpc/limits.py) -------
def _byte_count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _grpc_limit_options(group: Any) -> None:
    from dlserve.server.transport.grpc import limits

    options = (
        ("--grpc-max-message-size", _byte_count, limits.MAX_MESSAGE, "BYTES",
         "largest gRPC request message accepted as received; larger is RESOURCE_EXHAUSTED",
         ", Triton's"),
        ("--grpc-max-decompressed-size", _byte_count, limits.MAX_INFLATED, "BYTES",
         "largest a gzip or deflate request message may inflate to; larger is "
         "RESOURCE_EXHAUSTED", ""),
        ("--grpc-infer-max-fields", _byte_count, 4096, "COUNT",
         "most top-level fields a ModelInferRequest may have (its inputs, outputs, raw "
         "contents and parameters together); more is INVALID_ARGUMENT", ""),
        ("--grpc-connection-send-budget", _byte_count, limits.SEND_BUDGET, "BYTES",
         "responses one connection may leave unsent before its further calls wait", ""),
        ("--grpc-send-timeout", _seconds, limits.SEND_TIMEOUT_S, "SECONDS",
         "a connection whose responses wait while nothing moves for this long is closed "
         "and its calls cancelled", ""),
    )  # fmt: skip
    for flag, kind, default, unit, text, source in options:
        shown = f"{default:g}" if isinstance(default, float) else str(default)
        group.add_argument(
            flag, type=kind, default=default, metavar=unit,
            help=f"{text} (default {shown}{source})",
        )  # fmt: skip
