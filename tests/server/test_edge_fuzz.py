"""The gRPC edge's and the server<->worker codec's decoders under hypothesis
(``tests/grpc_fuzz.py`` says what each target checks): a bounded, reproducible run of each
(derandomized, no example database); ``tools/fuzz_grpc.py`` runs them longer."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from grpc_fuzz import TARGETS

EXAMPLES = {  # 4-8 s each
    "infer-request": 3000, "arriving-request": 3000, "grpc-messages": 3000, "ipc-codec": 1000,
}  # fmt: skip


@pytest.fixture
def allocations(request: pytest.FixtureRequest) -> Iterator[None]:
    """tracemalloc on for the codec's allocation bound (it slows the others for nothing)."""
    if request.node.callspec.params["name"] != "ipc-codec":
        yield
        return
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_target(name: str, allocations: None) -> None:
    strategy, check = TARGETS[name]

    @settings(
        max_examples=EXAMPLES[name], derandomize=True, database=None, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )  # fmt: skip
    @given(strategy)
    def run(case: Any) -> None:
        check(case)

    run()
