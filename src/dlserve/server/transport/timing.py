"""What the transports ask of tracing, as protocols the server's tracing meets: whether it
is on before they take a request's arrival time (``Timing``; the server gives its trace
settings), and a request's trace, whose response sending a gRPC call stamps (``Traced``).
With tracing off a request costs one attribute check here and no clock read."""

from __future__ import annotations

from typing import Final, Protocol


class Timing(Protocol):
    """Whether tracing is on now."""

    @property
    def active(self) -> bool: ...


class _Never:
    active = False


NEVER: Final[Timing] = _Never()


class Traced(Protocol):
    """A request's trace as a transport sees it: it stamps the sending of the response,
    then releases it."""

    def stamp(self, name: str, ns: int) -> None: ...

    def release(self) -> None: ...
