"""GUI test fixtures: offscreen Qt, an isolated app data tree, and waiting helpers."""
from __future__ import annotations

import os
import socket

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from app.paths import AppPaths  # noqa: E402


@pytest.fixture
def app_paths(tmp_path) -> AppPaths:
    return AppPaths.under(tmp_path / "moestudio").ensure()


def _port_free(port: int) -> bool:
    """No listener on it (connections in TIME_WAIT do not count: servers bind with SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.fixture
def port_is_free():
    """Checks that a loopback port was released (quitting must leave nothing behind)."""
    return _port_free
