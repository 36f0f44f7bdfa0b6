"""How long one client's work may hold the server's event loop before the others get a
turn. The loop serves every connection; a connection whose frames, or whose message's
inflating, cost more than this is cut there and goes on at the loop's next turn, so what
another client's request waits for at each of its steps is about this much, whatever
the work of the clients around it costs (docs/network-edge.md, Liveness)."""

from __future__ import annotations

import time
from typing import Final

TURN_S: Final = 100e-6
clock = time.perf_counter
