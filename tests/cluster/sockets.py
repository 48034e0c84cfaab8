"""What a process tree listens on (psutil), and a raw HTTP exchange for the limit tests."""

from __future__ import annotations

import ipaddress
import socket
import time

import psutil

LOOPBACK_V4_MAPPED = ipaddress.ip_network("::ffff:127.0.0.0/104")


def listening_sockets(root_pid: int) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every TCP socket listening, and every UDP socket bound, in the
    process and all its descendants."""
    root = psutil.Process(root_pid)
    found = []
    for process in [root, *root.children(recursive=True)]:
        try:
            connections = process.net_connections(kind="inet")
            name = process.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for connection in connections:
            is_udp_bound = connection.type == socket.SOCK_DGRAM and not connection.raddr
            if connection.status == psutil.CONN_LISTEN or is_udp_bound:
                found.append((name, connection.laddr.ip, connection.laddr.port))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    return ip.is_loopback or ip in LOOPBACK_V4_MAPPED


def off_loopback(found: list[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    return [entry for entry in found if not is_loopback(entry[1])]


def raw_exchange(host: str, port: int, payload: bytes, wait_s: float) -> tuple[bytes, float]:
    """Send payload and read until the server closes (or wait_s passes); the answer and the wait."""
    start = time.monotonic()
    chunks = []
    with socket.create_connection((host, port), timeout=wait_s) as connection:
        connection.sendall(payload)
        try:
            while chunk := connection.recv(65536):
                chunks.append(chunk)
        except (TimeoutError, ConnectionResetError):
            pass
    return b"".join(chunks), time.monotonic() - start
