"""Error and crash dialogs: a message a person can act on, details one click away, a copy button."""
from __future__ import annotations


from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (QDialog, QDialogButtonBox, QLabel, QPlainTextEdit, QPushButton, QVBoxLayout,
                               QWidget)

from app.worker_state import Crash


class ErrorDialog(QDialog):
    def __init__(self, title: str, message: str, details: str = "", parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle(title)
        self.details_text = f"{title}\n{message}\n\n{details}".strip()
        lay = QVBoxLayout(self)
        head = QLabel(f"<b>{title}</b>")
        msg = QLabel(message)
        msg.setWordWrap(True)
        lay.addWidget(head)
        lay.addWidget(msg)
        self.details = QPlainTextEdit(details, readOnly=True)
        self.details.setVisible(bool(details))
        self.details.setMinimumHeight(160)
        lay.addWidget(self.details, 1)
        self.buttons = QDialogButtonBox()
        self.copy_btn = QPushButton("Copy details")
        self.copy_btn.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.details_text))
        self.buttons.addButton(self.copy_btn, QDialogButtonBox.ActionRole)
        self.buttons.addButton(QDialogButtonBox.Close)
        self.buttons.rejected.connect(self.reject)
        lay.addWidget(self.buttons)
        self.resize(640, 380 if details else 160)


class CrashDialog(ErrorDialog):
    """The engine stopped: why (as far as the output tells), what to do, the log tail, Restart."""

    def __init__(self, crash: Crash, parent: QWidget | None = None):
        super().__init__(crash.title, f"{crash.summary}\n\n{crash.advice}", crash.tail or "(no output)", parent)
        self.crash = crash
        self.details_text = crash.details()
        self.restart_btn = QPushButton("Restart the engine")
        self.wizard_btn = QPushButton("Open setup\u2026")
        self.buttons.addButton(self.restart_btn, QDialogButtonBox.AcceptRole)
        self.buttons.addButton(self.wizard_btn, QDialogButtonBox.ActionRole)
        self.restart_btn.clicked.connect(self.accept)
