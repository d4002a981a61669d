"""One MoE Studio per user: a second launch raises the first window and exits, instead of
starting a second engine that would load the same model into memory again (Anki's pattern:
a per-user QLocalServer; a stale socket left by a crash is removed and taken over)."""
from __future__ import annotations


import getpass
import re

from PySide6.QtCore import QObject, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket


def server_name() -> str:
    try:
        user = getpass.getuser()
    except Exception:
        user = "user"
    return "moestudio-" + re.sub(r"[^A-Za-z0-9_.-]", "_", user)


class SingleInstance(QObject):
    activated = Signal()  # another launch asked this one to come to the front

    def __init__(self, name: str | None = None, parent: QObject | None = None):
        super().__init__(parent)
        self.name = name or server_name()
        self.server: QLocalServer | None = None

    def notify_running(self, timeout_ms: int = 500) -> bool:
        """True when another instance answered (and was asked to show itself)."""
        sock = QLocalSocket()
        sock.connectToServer(self.name)
        if not sock.waitForConnected(timeout_ms):
            return False
        sock.write(b"raise\n")
        sock.waitForBytesWritten(timeout_ms)
        sock.disconnectFromServer()
        return True

    def listen(self) -> bool:
        self.server = QLocalServer(self)
        self.server.setSocketOptions(QLocalServer.UserAccessOption)
        if not self.server.listen(self.name):
            QLocalServer.removeServer(self.name)  # a crashed instance left its socket file
            if not self.server.listen(self.name):
                return False
        self.server.newConnection.connect(self._connection)
        return True

    def _connection(self) -> None:
        while self.server is not None and self.server.hasPendingConnections():
            conn = self.server.nextPendingConnection()
            if conn.bytesAvailable() or conn.waitForReadyRead(300):
                conn.readAll()
            conn.close()
            conn.deleteLater()
            self.activated.emit()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
