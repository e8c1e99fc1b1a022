"""Which processes listen where, from /proc (Linux): the tests that check a
deployment listens on loopback only list every listening socket of every
process of a session (`ray start` runs its cluster in a session of its own,
whose id is its leader's pid; Ray's workers keep the session)."""

import ipaddress
import os
from pathlib import Path

TCP_LISTEN = "0A"
UDP_UNCONNECTED = "07"


def session_pids(sid: int) -> list[int]:
    """Every live process of session `sid`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # After the command (in parentheses, may hold spaces): state, ppid, pgrp, session.
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:
                pids.append(int(entry.name))
    return pids


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def _address(hex_addr: str) -> tuple[str, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    # /proc/net prints the address as 32-bit words in host (little-endian) order.
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def _listeners() -> dict[str, tuple[str, str, int]]:
    """socket inode -> (protocol, local ip, port) of every listening TCP and unconnected UDP socket."""
    out = {}
    for proto, state in (("tcp", TCP_LISTEN), ("tcp6", TCP_LISTEN), ("udp", UDP_UNCONNECTED), ("udp6", UDP_UNCONNECTED)):
        try:
            lines = Path(f"/proc/net/{proto}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == state:
                out[f[9]] = (proto, *_address(f[1]))
    return out


def listening(pids) -> list[tuple[int, str, str, str, int]]:
    """(pid, command, protocol, ip, port) of every socket the processes listen on."""
    listeners = _listeners()
    rows = []
    for pid in pids:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        for inode in _socket_inodes(pid):
            if inode in listeners:
                rows.append((pid, comm, *listeners[inode]))
    return sorted(set(rows))


def is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip).is_loopback
