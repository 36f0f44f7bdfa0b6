"""``dlserve_shm_regions`` and ``dlserve_shm_region_bytes``: the client shared-memory regions
registered now, by kind (``system``, ``cuda``), read from the registry when the metrics
endpoint is scraped (nothing is counted on a request's path).

Regions unregistered while requests still use them are counted until they go: their memory
is still mapped. A dashboard that shows these beside ``dlserve_shm_regions_reclaimed_total``
tells clients that forget to unregister from those that die.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from dlserve.server.core.shm.registry import RegionRegistry

REGIONS: Final = "dlserve_shm_regions"
BYTES: Final = "dlserve_shm_region_bytes"
KINDS: Final = ("system", "cuda")


class RegionCollector(Collector):
    def __init__(self, registry: RegionRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        counts = dict.fromkeys(KINDS, 0)
        sizes = dict.fromkeys(KINDS, 0)
        for kind, byte_size in self._registry.sizes():
            counts[kind] += 1
            sizes[kind] += byte_size
        regions = Metric(REGIONS, "Client shared memory regions registered, by kind", "gauge")
        size = Metric(BYTES, "Bytes of the client shared memory regions registered, by kind",
                      "gauge")  # fmt: skip
        for kind in KINDS:
            regions.add_sample(REGIONS, {"kind": kind}, counts[kind])
            size.add_sample(BYTES, {"kind": kind}, sizes[kind])
        yield regions
        yield size
