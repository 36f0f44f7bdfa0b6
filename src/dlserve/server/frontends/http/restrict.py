"""``--http-restricted-api``: refuses requests to a restricted group's routes that lack its
header, before anything else is looked at (as Triton checks before the method, the body,
the model), with 403 and Triton's message."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.routing import Match, Route

from dlserve.server.frontends.http.status_codes import error_body
from dlserve.server.frontends.restrictions import (
    HTTP_ROUTE_GROUPS,
    Restriction,
    Restrictions,
    group_of,
)

Scope = MutableMapping[str, Any]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

_FORBIDDEN = 403
_KNOWN_LIMIT = 4096  # (method, path) pairs remembered


class RouteGuard:
    """Finds the route a request goes to, as Starlette's router does (the first route
    that matches path and method, else the first that matches the path), and checks the
    header of its group."""

    def __init__(self, routes: list[Route], restrictions: Restrictions) -> None:
        self.routes: list[tuple[Route, Restriction | None]] = []
        self._known: dict[tuple[str, str], Restriction | None] = {}
        for route in routes:
            self.routes.append((route, restrictions.get(group_of(HTTP_ROUTE_GROUPS, route.path))))

    def restriction_of(self, scope: Scope) -> Restriction | None:
        """The restriction of the route the request goes to (None: none, or no route);
        remembered by method and path, as matching every route costs far more than the lookup."""
        key = (scope["method"], scope["path"])
        try:
            return self._known[key]
        except KeyError:
            pass
        if len(self._known) >= _KNOWN_LIMIT:  # paths are the clients' choice: bounded
            self._known.clear()
        found = self._known[key] = self._match(scope)
        return found

    def _match(self, scope: Scope) -> Restriction | None:
        partial: Restriction | None = None
        found_partial = False
        for route, restriction in self.routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return restriction
            if match is Match.PARTIAL and not found_partial:
                partial, found_partial = restriction, True
        return partial

    async def refused(self, scope: Scope, send: Send) -> bool:
        """Whether the request was refused (and answered)."""
        if scope["type"] != "http":
            return False
        restriction = self.restriction_of(scope)
        if restriction is None or restriction.allows_raw(scope["headers"]):
            return False
        body = error_body(restriction.http_message)
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]  # fmt: skip
        await send({"type": "http.response.start", "status": _FORBIDDEN, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return True
