"""The HTTP/2 options of ``dlserve serve`` (Triton's keepalive options and dlserve's
limits) fill the ``Limits`` every gRPC connection reads; values out of range are refused."""

from __future__ import annotations

import pytest

from dlserve.server.options import http2_limits, parser
from dlserve.server.transport.h2.limits import Limits


def _limits(*options: str) -> Limits:
    return http2_limits(parser().parse_args(["serve", "--model-repository", "x", *options]))


def test_the_defaults_are_the_limits_defaults() -> None:
    assert _limits() == Limits()


def test_each_option_sets_its_limit() -> None:
    limits = _limits(
        "--grpc-keepalive-time", "1000", "--grpc-keepalive-timeout", "500",
        "--grpc-keepalive-permit-without-calls", "true",
        "--grpc-http2-max-pings-without-data", "0",
        "--grpc-http2-min-recv-ping-interval-without-data", "10000",
        "--grpc-http2-max-ping-strikes", "5", "--grpc-http2-max-concurrent-streams", "7",
        "--grpc-http2-max-header-list-size", "4096", "--grpc-http2-max-frame-size", "65536",
        "--grpc-http2-max-resets-per-second", "9",
        "--grpc-http2-max-control-frames-per-second", "11", "--grpc-max-connection-idle", "0",
    )  # fmt: skip
    assert limits == Limits(
        max_concurrent_streams=7, max_header_list_size=4096, max_frame_size=65536,
        max_resets_per_s=9, max_control_frames_per_s=11, keepalive_time_ms=1000,
        keepalive_timeout_ms=500, keepalive_permit_without_calls=True,
        max_pings_without_data=0, min_recv_ping_interval_without_data_ms=10000,
        max_ping_strikes=5, max_connection_idle_ms=0,
    )  # fmt: skip


@pytest.mark.parametrize(
    "option",
    [("--grpc-http2-max-frame-size", "16383"), ("--grpc-http2-max-frame-size", "16777216"),
     ("--grpc-http2-max-concurrent-streams", "0"), ("--grpc-keepalive-time", "-1"),
     ("--grpc-http2-max-header-list-size", "100")],
)  # fmt: skip
def test_values_out_of_range_are_refused(option: tuple[str, str]) -> None:
    with pytest.raises(SystemExit):
        _limits(*option)
