"""Command line: ``dlserve serve --model-repository DIR ...``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

from dlserve.server import triton_options
from dlserve.server.frontends.restrictions import (
    GRPC_HEADER_PREFIX,
    RestrictionOptionError,
    Restrictions,
    parse_options,
)
from dlserve.server.options import DEPRECATED_TRACE, http2_limits
from dlserve.server.options import parser as _parser

if TYPE_CHECKING:
    from dlserve.server.core.cache.cache_config import CacheSettings
    from dlserve.server.transport.grpc.listener import TlsOptions


def _trace_config(args: argparse.Namespace) -> list[str]:
    """--trace-config's values, after those of Triton's deprecated options, which they
    override (as in Triton; levels add up)."""
    values: list[str] = []
    for name, setting in DEPRECATED_TRACE.items():
        given = getattr(args, name[2:].replace("-", "_"))
        if given:
            print(f"Warning: '{name}' has been deprecated and will be removed in a future "
                  f"release. Please use '--trace-config {setting}=<value>' instead.",
                  file=sys.stderr)  # fmt: skip
        values.extend(f"{setting}={value}" for value in given)
    config: list[str] = args.trace_config
    return values + config


def _log_to(path: str, parser: argparse.ArgumentParser) -> None:
    """Make the file this process's stderr: the server's log lines go there, and so do the
    workers', which inherit it (``pb_utils.Logger`` writes to the worker's stderr)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as exc:
        parser.error(f"--log-file: cannot open {path}: {exc.strerror}")
    os.dup2(fd, 2)
    os.close(fd)


def _grpc_tls(args: argparse.Namespace, parser: argparse.ArgumentParser) -> TlsOptions | None:
    """The TLS options of the gRPC endpoint, or None; a missing file is a usage error."""
    if not (args.grpc_use_ssl or args.grpc_use_ssl_mutual):
        return None
    if not (args.grpc_server_cert and args.grpc_server_key):
        parser.error("--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key")
    if args.grpc_use_ssl_mutual and not args.grpc_root_cert:
        parser.error("--grpc-use-ssl-mutual needs --grpc-root-cert")
    from dlserve.server.transport.grpc.listener import TlsOptions

    return TlsOptions(
        args.grpc_server_cert, args.grpc_server_key, args.grpc_root_cert,
        args.grpc_use_ssl_mutual,
    )  # fmt: skip


def _cache(args: argparse.Namespace, parser: argparse.ArgumentParser) -> CacheSettings | None:
    """The response cache the options ask for; a bad one stops the server before it starts."""
    from dlserve.server.core.cache.cache_config import CacheConfigError, parse_cache_config

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
    if (sys.argv[1:] if argv is None else argv)[:1] == ["doctor"]:  # checks a host, serves nothing
        from dlserve.doctor.main import main as doctor

        return doctor((sys.argv[1:] if argv is None else argv)[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    warnings = triton_options.check(args, parser)
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
    from dlserve.server.core.telemetry.trace_config import parse_trace_config

    try:
        trace = parse_trace_config(_trace_config(args), os.getcwd())
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(asctime)s %(levelname).1s %(name)s: %(message)s"
    )
    for warning in warnings:  # Triton's tuning options: accepted, said to change nothing
        print(warning, file=sys.stderr)
    from dlserve.server.transport.grpc.limits import GrpcLimits
    from dlserve.server.transport.http1.limits import Http1Limits
    from dlserve.server.wiring import ServerOptions, run

    options = ServerOptions(
        model_repository=args.model_repository.resolve(),
        host=args.host,
        grpc_host=args.grpc_address,
        http_host=args.http_address,
        metrics_host=args.metrics_address,
        server_id=args.id,
        model_config_name=args.model_config_name,
        exit_on_error=args.exit_on_error,
        log_format=args.log_format,
        cpu_metrics=args.allow_cpu_metrics,
        gpu_metrics=args.allow_gpu_metrics,
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
        **({} if args.request_poll_us is None else {"request_poll_us": args.request_poll_us}),
        grpc_uds=os.path.abspath(args.grpc_uds) if args.grpc_uds else None,
        shm_idle_timeout=args.shm_idle_timeout,
        mps=args.mps,
        bls_direct=args.bls_direct,
        grpc_tls=tls,
        trace=trace,
        cache=cache,
        grpc_restrictions=grpc_restrictions,
        http_restrictions=http_restrictions,
        http_limits=Http1Limits(
            max_connections=args.http_max_connections,
            header_timeout=args.http_header_timeout,
            body_timeout=args.http_body_timeout,
            body_min_rate=args.http_body_min_rate,
            idle_timeout=args.http_idle_timeout,
            send_timeout=args.http_send_timeout,
        ),
        grpc_max_connections=args.grpc_max_connections,
        grpc_http2=http2_limits(args),
        grpc_limits=GrpcLimits(
            args.grpc_max_message_size,
            args.grpc_max_decompressed_size,
            args.grpc_connection_send_budget,
            args.grpc_send_timeout,
        ),
        grpc_infer_max_fields=args.grpc_infer_max_fields,
    )
    profile = os.environ.get("DLSERVE_SERVER_PROFILE")
    if profile:  # a developer's switch: cProfile the server process into this file
        import cProfile

        result: list[int] = []
        cProfile.runctx("result.append(run(options))", globals(), locals(), profile)
        return result[0]
    return run(options)
