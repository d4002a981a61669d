"""The API tab: the server's fixed address (host, port) and key, editable, and the URLs clients
use, each with a copy button. The address is the app settings' (app/address.py); it is shown
whether or not the engine runs, since it does not change between starts."""
from __future__ import annotations


from PySide6.QtCore import Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (QFormLayout, QGroupBox, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit, QPushButton,
                               QSpinBox, QToolButton, QVBoxLayout, QWidget)

from app.address import base_url
from app.api_client import anthropic_base_url, openai_base_url
from app.credentials import new_api_key
from engine.server.cli import is_loopback


def copy_row(edit: QLineEdit) -> QWidget:
    """The field with a Copy button beside it (a secret field copies its `secret` property)."""
    w = QWidget()
    lay = QHBoxLayout(w)
    lay.setContentsMargins(0, 0, 0, 0)
    btn = QToolButton(text="Copy")
    btn.clicked.connect(lambda: QGuiApplication.clipboard().setText(edit.property("secret") or edit.text()))
    lay.addWidget(edit, 1)
    lay.addWidget(btn)
    w.copy_button = btn
    return w


class ApiPanel(QWidget):
    applyRequested = Signal(str, int, str)  # host, port, key: save them and restart the engine

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        box = QGroupBox("API server (OpenAI- and Anthropic-compatible)")
        form = QFormLayout(box)
        self.host = QLineEdit()
        self.host.setToolTip("127.0.0.1: this computer only; 0.0.0.0: every network interface (other computers "
                             "on your network can then connect, with the key)")
        self.port = QSpinBox()
        self.port.setRange(1, 65535)
        self.port.setToolTip("A fixed port: the address stays the same across engine restarts")
        self.key = QLineEdit()
        self.key.setEchoMode(QLineEdit.Password)
        self.show_key = QToolButton(text="Show", checkable=True)
        self.show_key.toggled.connect(lambda on: self.key.setEchoMode(QLineEdit.Normal if on else QLineEdit.Password))
        self.new_key = QToolButton(text="New key")
        self.new_key.setToolTip("Replace the key with a new random one (clients using the old one stop working)")
        self.new_key.clicked.connect(lambda: self.key.setText(new_api_key()))
        self.key.textChanged.connect(lambda text: self.key.setProperty("secret", text))
        key_row = copy_row(self.key)
        key_row.layout().insertWidget(1, self.show_key)
        key_row.layout().addWidget(self.new_key)
        self.apply_btn = QPushButton("Save and restart the engine")
        self.apply_btn.clicked.connect(self._apply)
        self.error = QLabel()
        self.error.setWordWrap(True)
        self.error.setStyleSheet("color: #d04040")
        form.addRow("Host", self.host)
        form.addRow("Port", self.port)
        form.addRow("API key", key_row)
        form.addRow(self.error)
        form.addRow("", self.apply_btn)

        urls = QGroupBox("Connect a client")
        uf = QFormLayout(urls)
        self.status = QLabel()
        self.url = QLineEdit(readOnly=True)
        self.openai_url = QLineEdit(readOnly=True)
        self.anthropic_url = QLineEdit(readOnly=True)
        self.url_row = copy_row(self.url)
        uf.addRow("Status", self.status)
        uf.addRow("Server URL", self.url_row)
        uf.addRow("OpenAI base URL", copy_row(self.openai_url))
        uf.addRow("Anthropic base URL", copy_row(self.anthropic_url))
        self.example = QPlainTextEdit(readOnly=True)
        self.example.setMaximumHeight(90)
        ex_copy = QPushButton("Copy example")
        ex_copy.clicked.connect(lambda: QGuiApplication.clipboard().setText(self._example(reveal=True)))
        self.show_key.toggled.connect(lambda _on: self.example.setPlainText(self._example()))
        uf.addRow("Example", self.example)
        uf.addRow("", ex_copy)
        self.note = QLabel()
        self.note.setWordWrap(True)
        uf.addRow(self.note)

        lay = QVBoxLayout(self)
        lay.addWidget(box)
        lay.addWidget(urls)
        lay.addStretch(1)
        self.set_running(False)
        self._saved: tuple[str, int, str] = ("", 0, "")

    def set_address(self, host: str, port: int, api_key: str) -> None:
        """The saved address and key (the engine serves on them once ready)."""
        self._saved = (host, port, api_key)
        self.host.setText(host)
        self.port.setValue(port)
        self.key.setText(api_key)
        url = base_url(host, port)
        self.url.setText(url)
        self.openai_url.setText(openai_base_url(url))
        self.anthropic_url.setText(anthropic_base_url(url))
        where = ("this computer only" if is_loopback(host) else
                 "every client that can reach this computer on the network")
        self.note.setText(f"The server listens on {host}:{port}, open to {where}; every request needs the key, "
                          "which is kept in your config folder, readable by you only.")
        self.example.setPlainText(self._example())
        self.error.setText("")

    def set_running(self, running: bool) -> None:
        self.status.setText("serving" if running else "not serving now (the engine is not ready); "
                            "the address stays the same at the next start")

    def _example(self, reveal: bool = False) -> str:
        """A working client snippet; the key shows only when revealed (Show) or copied."""
        host, port, key = self._saved
        if not port:
            return ""
        if not (reveal or self.show_key.isChecked()):
            key = "\u2022" * 8 + " (Show or Copy reveals it)"
        return (f"from openai import OpenAI\nclient = OpenAI(base_url=\"{openai_base_url(base_url(host, port))}\", "
                f"api_key=\"{key}\")\nprint(client.chat.completions.create(model=\"local\", messages=[{{\"role\": "
                "\"user\", \"content\": \"Hello\"}]).choices[0].message.content)")

    def _apply(self) -> None:
        self.error.setText("")  # the main window checks the values and reports here
        self.applyRequested.emit(self.host.text().strip(), self.port.value(), self.key.text().strip())
