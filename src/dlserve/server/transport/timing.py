"""What the transports ask before they take a request's arrival time: whether tracing is on
(``server/core/telemetry/trace_settings.py``'s ``TraceSettings.active``). With tracing off a
request costs one
attribute check here and no clock read."""

from __future__ import annotations

from typing import Final, Protocol


class Timing(Protocol):
    @property
    def active(self) -> bool: ...


class _Never:
    active = False


NEVER: Final[Timing] = _Never()


class Traced(Protocol):
    """A request's trace as a transport sees it (``server/core/telemetry/tracer.py``'s ``Trace``):
    it stamps the sending of the response, then releases it."""

    def stamp(self, name: str, ns: int) -> None: ...

    def release(self) -> None: ...
