"""Which local process is at the other end of a connection, asked of /proc.

- loopback TCP: the peer's socket is the entry of ``/proc/net/tcp{,6}`` whose local address
  is the peer's address and port; the processes holding it are those with a descriptor
  ``socket:[inode]`` in ``/proc/*/fd``.
- (a Unix socket needs no /proc: the frontend asks the call's own connection, SO_PEERCRED)

Only processes of the server's user (or every process, for root) can be seen; a peer that
cannot be seen has no owner, and its regions are never reclaimed by owner exit.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Collection, Iterable
from typing import Final

PROC: Final = "/proc"
TCP_ESTABLISHED: Final = "01"

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _ip(address: str) -> IpAddress | None:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _decode(field: str) -> tuple[IpAddress | None, int]:
    """``/proc/net/tcp``'s "0100007F:1F90": the address in 32-bit words of host order."""
    text, _, port = field.partition(":")
    raw = bytes.fromhex(text)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return ipaddress.IPv4Address(words), int(port, 16)
    ip = ipaddress.IPv6Address(words)
    return (ip.ipv4_mapped or ip), int(port, 16)


def tcp_socket_inodes(address: str, port: int) -> set[int]:
    """The inodes of the established TCP sockets whose local end is ``address:port``."""
    wanted = _ip(address)
    found: set[int] = set()
    if wanted is None:
        return found
    for table in ("tcp", "tcp6"):
        try:
            with open(os.path.join(PROC, "net", table)) as lines:
                next(lines, None)  # the header
                for line in lines:
                    fields = line.split()
                    if len(fields) < 10 or fields[3] != TCP_ESTABLISHED:
                        continue
                    if _decode(fields[1]) == (wanted, port):
                        found.add(int(fields[9]))
        except OSError:
            continue
    return found


def _pids() -> Iterable[int]:
    with os.scandir(PROC) as entries:
        for entry in entries:
            if entry.name.isdigit():
                yield int(entry.name)


def processes_holding(inodes: Collection[int]) -> set[int]:
    """The processes with a descriptor of one of these sockets (that we may look at)."""
    links = {f"socket:[{inode}]" for inode in inodes}
    holders: set[int] = set()
    if not links:
        return holders
    for pid in _pids():
        directory = os.path.join(PROC, str(pid), "fd")
        try:
            names = os.listdir(directory)
        except OSError:
            continue  # gone, or not ours to see
        for name in names:
            try:
                if os.readlink(os.path.join(directory, name)) in links:
                    holders.add(pid)
                    break
            except OSError:
                continue
    return holders


def tcp_peer_processes(address: str, port: int) -> set[int]:
    """The local processes holding the client end of a connection from ``address:port``.

    A connection registers again and again (a client registering per request): the
    holders found for its socket are remembered and only checked the next time, which
    spares a scan of every process's descriptors.
    """
    inodes = tcp_socket_inodes(address, port)
    if len(inodes) == 1:
        (inode,) = inodes
        known = _HOLDERS.get(inode)
        if known and all(_holds(pid, inode) for pid in known):
            return set(known)
    holders = processes_holding(inodes)
    if len(inodes) == 1 and holders:
        if len(_HOLDERS) >= _HOLDERS_MAX:
            _HOLDERS.clear()
        _HOLDERS[inodes.pop()] = frozenset(holders)
    return holders


_HOLDERS: dict[int, frozenset[int]] = {}  # socket inode -> the processes last seen holding it
_HOLDERS_MAX: Final = 4096


def _holds(pid: int, inode: int) -> bool:
    directory = os.path.join(PROC, str(pid), "fd")
    link = f"socket:[{inode}]"
    try:
        names = os.listdir(directory)
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(os.path.join(directory, name)) == link:
                return True
        except OSError:
            continue
    return False
