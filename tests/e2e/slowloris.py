"""The slowloris attacker of the HTTP/1.1 edge's tests, as a process of its own.

``python slowloris.py PORT COUNT``: opens COUNT connections to 127.0.0.1:PORT, starts a
request on each (its request line) and then drips one more header line onto each every
0.25 s, never ending a head, at the lowest priority (``os.nice(19)``: the attacker's CPU
is not the server's). It prints ``open N`` once N connections are open, then, once the
server has closed them all (or after 60 s), one JSON line: how many were opened, how many
the server answered with a 408, how many it closed, and the seconds from the last open to
the last close.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import sys
import time

DRIP_S = 0.25
DEADLINE_S = 60.0


def main(port: int, count: int) -> None:
    os.nice(19)
    selector = selectors.DefaultSelector()
    answers: dict[socket.socket, bytes] = {}
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\n")
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        answers[sock] = b""
    opened = time.monotonic()
    print(f"open {len(answers)}", flush=True)
    timed_out = closed = 0
    last = opened
    next_drip = opened + DRIP_S
    while answers and time.monotonic() < opened + DEADLINE_S:
        for key, _ in selector.select(timeout=max(0.0, next_drip - time.monotonic())):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if data:
                answers[sock] += data
                continue
            timed_out += answers.pop(sock).startswith(b"HTTP/1.1 408 ")
            closed += 1
            last = time.monotonic()
            selector.unregister(sock)
            sock.close()
        if time.monotonic() >= next_drip:
            next_drip += DRIP_S
            for sock in list(answers):
                try:
                    sock.send(b"x-drip: 1\r\n")
                except OSError:
                    pass  # closed: its EOF is read above
    report = {"opened": count, "timed_out": timed_out, "closed": closed,
              "seconds": last - opened}  # fmt: skip
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
