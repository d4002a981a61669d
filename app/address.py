"""The API server's fixed address: checking it, finding whether its port is free, and the URL
clients use. No Qt.

The app serves on one fixed address (app settings: api_host, api_port) so that tools configured
against it keep working across engine restarts. The port defaults to `moestudio serve`'s own
default (engine/config.py), the one place that number is defined.
"""
from __future__ import annotations

import errno
import ipaddress
import socket

from engine.config import Config
from engine.errors import UserError

DEFAULT_API_HOST = Config.__dataclass_fields__["host"].default
DEFAULT_API_PORT = Config.__dataclass_fields__["port"].default
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def check_address(host: str, port: int) -> tuple[str, int]:
    """The address as given, or a UserError saying what is wrong with it."""
    host = (host or "").strip()
    if not host:
        raise UserError("API host: give an address to listen on, e.g. 127.0.0.1 (this computer only) "
                        "or 0.0.0.0 (every network interface)")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise UserError(f"API port must be an integer in [1, 65535], got {port!r}")
    return host, port


def connect_host(host: str) -> str:
    """Where a client on this computer reaches a server listening on `host`."""
    return "127.0.0.1" if host in WILDCARD_HOSTS else host


def base_url(host: str, port: int) -> str:
    h = connect_host(host)
    try:
        if ipaddress.ip_address(h).version == 6:
            h = f"[{h}]"
    except ValueError:
        pass  # a host name
    return f"http://{h}:{port}"


def port_in_use(host: str, port: int) -> bool:
    """Whether a server could not listen on host:port now (as uvicorn binds: SO_REUSEADDR, so
    connections left in TIME_WAIT by the previous engine do not count)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as e:
        if e.errno in (errno.EADDRINUSE, errno.EACCES):
            return True
        raise UserError(f"API host: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return False


def next_free_port(host: str, port: int, tries: int = 100) -> int | None:
    """The first port above `port` that is free on `host` (None if the next `tries` are all taken)."""
    for candidate in range(port + 1, min(port + 1 + tries, 65536)):
        if not port_in_use(host, candidate):
            return candidate
    return None
