"""Command line: ``dlserve serve --model-repository DIR ...``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlserve import __version__
from dlserve.frontends.restrictions import (
    GROUPS,
    GRPC_HEADER_PREFIX,
    RestrictionOptionError,
    Restrictions,
    parse_options,
)

if TYPE_CHECKING:
    from dlserve.core.cache_config import CacheSettings
    from dlserve.frontends.grpc.transport import TlsOptions


_DEPRECATED_TRACE = {
    "--trace-file": "triton,file", "--trace-level": "level", "--trace-rate": "rate",
    "--trace-count": "count", "--trace-log-frequency": "triton,log-frequency",
}  # fmt: skip


def _trace_config(args: argparse.Namespace) -> list[str]:
    """--trace-config's values, after those of Triton's deprecated options, which they
    override (as in Triton; levels add up)."""
    values: list[str] = []
    for name, setting in _DEPRECATED_TRACE.items():
        given = getattr(args, name[2:].replace("-", "_"))
        if given:
            print(f"Warning: '{name}' has been deprecated and will be removed in a future "
                  f"release. Please use '--trace-config {setting}=<value>' instead.",
                  file=sys.stderr)  # fmt: skip
        values.extend(f"{setting}={value}" for value in given)
    config: list[str] = args.trace_config
    return values + config


def _microseconds(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _log_to(path: str, parser: argparse.ArgumentParser) -> None:
    """Make the file this process's stderr: the server's log lines go there, and so do the
    workers', which inherit it (``pb_utils.Logger`` writes to the worker's stderr)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as exc:
        parser.error(f"--log-file: cannot open {path}: {exc.strerror}")
    os.dup2(fd, 2)
    os.close(fd)


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


def _grpc_tls(args: argparse.Namespace, parser: argparse.ArgumentParser) -> TlsOptions | None:
    """The TLS options of the gRPC endpoint, or None; a missing file is a usage error."""
    if not (args.grpc_use_ssl or args.grpc_use_ssl_mutual):
        return None
    if not (args.grpc_server_cert and args.grpc_server_key):
        parser.error("--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key")
    if args.grpc_use_ssl_mutual and not args.grpc_root_cert:
        parser.error("--grpc-use-ssl-mutual needs --grpc-root-cert")
    from dlserve.frontends.grpc.transport import TlsOptions

    return TlsOptions(
        args.grpc_server_cert, args.grpc_server_key, args.grpc_root_cert,
        args.grpc_use_ssl_mutual,
    )  # fmt: skip


def _cache(args: argparse.Namespace, parser: argparse.ArgumentParser) -> CacheSettings | None:
    """The response cache the options ask for; a bad one stops the server before it starts."""
    from dlserve.core.cache_config import CacheConfigError, parse_cache_config

    values = list(args.cache_config)
    if args.response_cache_byte_size is not None:
        if values:
            parser.error("Incompatible flags --response-cache-byte-size and --cache-config "
                         "both provided. Please provide one or the other.")  # fmt: skip
        values = [f"local,size={args.response_cache_byte_size}"]
    try:
        return parse_cache_config(values)
    except CacheConfigError as exc:
        parser.error(f"--cache-config: {exc}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlserve", description=__doc__)
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
        "--exit-on-error", type=_flag, nargs="?", const=True, default=False, metavar="BOOL",
        help="true: stop (exit status 1) when a model fails to load at startup, as Triton "
        "does by default; false: serve the others, the failed ones UNAVAILABLE (default false)",
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
        "--log-file", metavar="PATH",
        help="append the server's and the models' log lines (their stderr) to this file",
    )  # fmt: skip
    group.add_argument(
        "--trace-config", action="append", default=[], metavar="[triton,]SETTING=VALUE",
        help="Triton's request tracing: level=OFF|TIMESTAMPS|TENSORS (repeatable), rate=N "
        "(every N-th request), count=N (-1: no limit), mode=triton, triton,file=PATH, "
        "triton,log-frequency=N (write every N traces to PATH.<n>); repeatable",
    )  # fmt: skip
    for name, setting in _DEPRECATED_TRACE.items():  # Triton's older spellings
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


def _restrictions(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[
    Restrictions, Restrictions
]:  # fmt: skip
    """The gRPC and HTTP restricted groups; a bad value is a usage error (Triton's text)."""
    try:
        return (
            parse_options(args.grpc_restricted_protocol, "grpc-restricted-protocol",
                          "protocol", GRPC_HEADER_PREFIX),
            parse_options(args.http_restricted_api, "http-restricted-api", "api"),
        )  # fmt: skip
    except RestrictionOptionError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    tls = _grpc_tls(args, parser)
    cache = _cache(args, parser)
    grpc_restrictions, http_restrictions = _restrictions(args, parser)
    if not (args.allow_grpc or args.allow_http):
        parser.error("--allow-grpc and --allow-http are both false: nothing would serve requests")
    if any(c.isspace() for c in args.model_config_name):
        parser.error("--model-config-name must not contain spaces (it names configs/NAME.pbtxt)")
    level = logging.DEBUG if args.log_verbose else logging.INFO
    if args.log_verbose:  # workers inherit it: pb_utils.Logger.log_verbose prints
        os.environ["DLSERVE_LOG_VERBOSE"] = str(args.log_verbose)
    if args.log_file:
        _log_to(args.log_file, parser)
    from dlserve.core.trace_config import parse_trace_config

    try:
        trace = parse_trace_config(_trace_config(args), os.getcwd())
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname).1s %(name)s: %(message)s"
    )
    from dlserve.server import ServerOptions, run

    options = ServerOptions(
        model_repository=args.model_repository.resolve(),
        host=args.host,
        grpc_host=args.grpc_address,
        http_host=args.http_address,
        metrics_host=args.metrics_address,
        server_id=args.id,
        model_config_name=args.model_config_name,
        exit_on_error=args.exit_on_error,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        model_control_mode=args.model_control_mode,
        repository_poll_secs=args.repository_poll_secs,
        strict_readiness=args.strict_readiness,
        shutdown_timeout=args.exit_timeout_secs,
        auto_complete=not (args.disable_auto_complete_config or args.strict_model_config),
        allow_grpc=args.allow_grpc,
        allow_http=args.allow_http,
        allow_metrics=args.allow_metrics,
        load_models=args.load_model,
        http_max_input_size=args.http_max_input_size,
        in_process_workers=args.debug,
        ready_fd=args.ready_fd,
        allow_client_shm=args.allow_client_shm,
        busy_poll_us=args.busy_poll_us,
        log_verbose=args.log_verbose,
        log_levels=(args.log_info, args.log_warning, args.log_error),
        log_file=os.path.abspath(args.log_file) if args.log_file else "",
        **({} if args.reply_poll_us is None else {"reply_poll_us": args.reply_poll_us}),
        grpc_uds=os.path.abspath(args.grpc_uds) if args.grpc_uds else None,
        shm_idle_timeout=args.shm_idle_timeout,
        mps=args.mps,
        grpc_tls=tls,
        trace=trace,
        cache=cache,
        grpc_restrictions=grpc_restrictions,
        http_restrictions=http_restrictions,
    )
    profile = os.environ.get("DLSERVE_SERVER_PROFILE")
    if profile:  # a developer's switch: cProfile the server process into this file
        import cProfile

        result: list[int] = []
        cProfile.runctx("result.append(run(options))", globals(), locals(), profile)
        return result[0]
    return run(options)
