"""The restricted groups' table, the options' parsing (Triton's messages) and the header
check, without a server; the server's behaviour is tests/e2e/test_restricted.py."""

from __future__ import annotations

from typing import Any

import pytest

from dlserve.server import cli
from dlserve.server.frontends.grpc.servicer import GrpcServicer, method_handlers
from dlserve.server.frontends.http.app import HttpApp
from dlserve.server.frontends.restrictions import (
    GROUPS,
    GRPC_HEADER_PREFIX,
    GRPC_METHOD_GROUPS,
    HTTP_ROUTE_GROUPS,
    Restriction,
    RestrictionOptionError,
    parse_options,
)

NO_SERVICE: Any = None  # the tables are built without calling the service


def test_every_grpc_method_has_a_group_and_every_group_a_method() -> None:
    methods = set(method_handlers(GrpcServicer(NO_SERVICE)))
    assert methods == set(GRPC_METHOD_GROUPS)
    assert set(GRPC_METHOD_GROUPS.values()) == set(GROUPS)


def test_every_http_route_has_a_group_and_every_group_a_route() -> None:
    routes = {route.path for route in HttpApp(NO_SERVICE, 1024, {}).router.routes}  # type: ignore[attr-defined]
    assert routes == set(HTTP_ROUTE_GROUPS)
    assert set(HTTP_ROUTE_GROUPS.values()) == set(GROUPS)


def test_groups_are_tritons_in_its_order() -> None:
    assert GROUPS == (
        "health", "metadata", "inference", "shared-memory", "model-config",
        "model-repository", "statistics", "trace", "logging",
    )  # fmt: skip


def test_an_option_restricts_each_of_its_groups() -> None:
    parsed = parse_options(
        ["model-repository,shared-memory:admin-key=se=cret", "health:k=v"],
        "grpc-restricted-protocol", "protocol", GRPC_HEADER_PREFIX,
    )  # fmt: skip
    admin = Restriction("triton-grpc-protocol-admin-key", "se=cret")  # the key ends at '='
    assert parsed == {
        "model-repository": admin, "shared-memory": admin,
        "health": Restriction("triton-grpc-protocol-k", "v"),
    }  # fmt: skip


FORMAT = "--http-restricted-api option format is '<config name>:<setting>=<value>'. Got {}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nothing:k=v"], "unknown restricted api 'nothing'"),
        (["health,,metadata:k=v"], "unknown restricted api ''"),
        (["Health:k=v"], "unknown restricted api 'Health'"),
        (["health"], FORMAT.format("health")),
        (["health:k"], FORMAT.format("health:k")),
        ([":k=v"], FORMAT.format(":k=v")),
        (["health:=v"], FORMAT.format("health:=v")),
        (["health:k="], FORMAT.format("health:k=")),
        (["health=k:v"], FORMAT.format("health=k:v")),
        (["health,health:k=v"],
         "restricted api 'health' can not be specified in multiple config groups"),
        (["health:k=v", "metadata,health:k=v"],
         "restricted api 'health' can not be specified in multiple config groups"),
    ],
)  # fmt: skip
def test_bad_values_are_refused_with_tritons_messages(args: list[str], message: str) -> None:
    with pytest.raises(RestrictionOptionError) as caught:
        parse_options(args, "http-restricted-api", "api")
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--grpc-restricted-protocol=everything:k=v"], "unknown restricted protocol 'everything'"),
        (["--http-restricted-api=health"],
         "--http-restricted-api option format is '<config name>:<setting>=<value>'. Got health"),
        (["--grpc-restricted-protocol=trace:a=b", "--grpc-restricted-protocol=trace:a=b"],
         "restricted protocol 'trace' can not be specified in multiple config groups"),
    ],
)  # fmt: skip
def test_the_command_line_refuses_bad_values(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        cli.main(["serve", "--model-repository", "/nonexistent", *argv])
    assert caught.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"error: {message}")


def test_one_group_may_be_restricted_on_both_protocols() -> None:
    grpc = parse_options(["health:k=v"], "grpc-restricted-protocol", "protocol")
    http = parse_options(["health:k=v"], "http-restricted-api", "api")
    assert grpc == http == {"health": Restriction("k", "v")}


def test_header_names_match_in_any_case_values_exactly() -> None:
    restriction = Restriction("Admin-Key", "Secret")
    assert restriction.allows([("admin-key", "Secret")])
    assert restriction.allows([("ADMIN-KEY", "Secret")])
    assert not restriction.allows([("admin-key", "secret")])
    assert not restriction.allows([("other", "Secret")])
    assert not restriction.allows([("admin-key", "wrong"), ("admin-key", "Secret")])  # first
    assert restriction.allows_raw([(b"admin-key", b"Secret")])
    assert not restriction.allows_raw([(b"admin-key", b"Secret ")])
    assert restriction.http_message == "This API is restricted, expecting header 'Admin-Key'"


def test_a_non_ascii_value_matches_as_its_utf8_bytes() -> None:
    restriction = Restriction("k", "clé")
    assert restriction.allows_raw([(b"k", "clé".encode())])
    assert restriction.allows([("k", "clé".encode().decode("latin-1"))])  # as HPACK decodes


def _scope(method: str, path: str) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "root_path": "", "headers": []}


def test_the_http_guard_finds_the_route_the_router_takes() -> None:
    admin, stats = Restriction("a", "1"), Restriction("s", "2")
    app = HttpApp(NO_SERVICE, 1024, {"model-repository": admin, "statistics": stats})
    guard = app.guard
    assert guard is not None
    assert guard.restriction_of(_scope("GET", "/v2/models/stats")) is stats  # not metadata
    assert guard.restriction_of(_scope("POST", "/v2/models/stats")) is stats  # wrong method
    assert guard.restriction_of(_scope("POST", "/v2/repository/models/m/load")) is admin
    assert guard.restriction_of(_scope("GET", "/v2/repository/models/m/load")) is admin
    assert guard.restriction_of(_scope("POST", "/v2/models/m/infer")) is None
    assert guard.restriction_of(_scope("GET", "/no/such/route")) is None


def test_the_http_guard_remembers_a_bounded_number_of_paths() -> None:
    admin = Restriction("a", "1")
    guard = HttpApp(NO_SERVICE, 1024, {"model-repository": admin}).guard
    assert guard is not None
    for n in range(10_000):
        assert guard.restriction_of(_scope("POST", f"/v2/repository/models/m{n}/load")) is admin
    assert len(guard._known) <= 4096
