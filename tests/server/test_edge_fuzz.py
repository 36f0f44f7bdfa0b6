"""The gRPC edge's and the server<->worker codec's decoders under hypothesis
(``tests/grpc_fuzz.py`` says what each target checks): a bounded, reproducible run of each
(derandomized, no example database); ``tools/fuzz.py grpc`` runs them longer, with random
seeds (``fuzzing.py``)."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given

from fuzzing import fuzz_settings
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

    @fuzz_settings(EXAMPLES[name])
    @given(strategy)
    def run(case: Any) -> None:
        check(case)

    run()
