"""How the suite's hypothesis fuzzers run. In the suite, a fixed number of examples each,
derandomized (every run tries the same cases), with no example database. ``tools/fuzz.py``
runs the same properties longer: ``DLSERVE_FUZZ_EXAMPLES`` sets the examples of each, and
``DLSERVE_FUZZ_RANDOM`` leaves the cases to the seed it passes (``--hypothesis-seed``)."""

from __future__ import annotations

import os
from collections.abc import Iterable

from hypothesis import HealthCheck, settings

SLOW_OR_LARGE = (HealthCheck.too_slow, HealthCheck.data_too_large)


def fuzz_settings(examples: int, suppress: Iterable[HealthCheck] = SLOW_OR_LARGE) -> settings:
    """``examples`` in the suite (``DLSERVE_FUZZ_EXAMPLES`` where set), health checks in
    ``suppress`` off (the inputs are large and slow on purpose)."""
    return settings(
        max_examples=int(os.environ.get("DLSERVE_FUZZ_EXAMPLES", examples)),
        derandomize="DLSERVE_FUZZ_RANDOM" not in os.environ,
        database=None, deadline=None, suppress_health_check=list(suppress),
    )  # fmt: skip
