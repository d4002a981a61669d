"""The Settings & API tab: the API server's address, key and base URLs with copy buttons, and
every engine option of the current preset (engine/config.py's schema, one field per option)."""
from __future__ import annotations


from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (QComboBox, QFileDialog, QFormLayout, QGroupBox, QHBoxLayout, QLabel, QLineEdit,
                               QPlainTextEdit, QPushButton, QScrollArea, QToolButton, QVBoxLayout, QWidget)

from engine.config import ENGINES, FIELDS, LOAD_MODES, POLICIES, Config, flag
from engine.errors import UserError

from app.api_client import anthropic_base_url, openai_base_url

APP_MANAGED = ("host", "port", "api_key")  # the app picks a free loopback port and generates the key
CHOICES = {"engine": ENGINES, "moe_profile_adapt": POLICIES, "load_mode": LOAD_MODES}


def _copy_row(edit: QLineEdit) -> QWidget:
    w = QWidget()
    lay = QHBoxLayout(w)
    lay.setContentsMargins(0, 0, 0, 0)
    btn = QToolButton(text="Copy")
    btn.clicked.connect(lambda: QGuiApplication.clipboard().setText(edit.property("secret") or edit.text()))
    lay.addWidget(edit, 1)
    lay.addWidget(btn)
    w.copy_button = btn
    return w


class SettingsPanel(QWidget):
    applyRequested = Signal(object)  # Config: save to the current preset and restart the engine

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        # ---- API ----
        api = QGroupBox("API server (OpenAI- and Anthropic-compatible)")
        af = QFormLayout(api)
        self.url = QLineEdit(readOnly=True)
        self.key = QLineEdit(readOnly=True)
        self.key.setEchoMode(QLineEdit.Password)
        self.show_key = QToolButton(text="Show", checkable=True)
        self.show_key.toggled.connect(lambda on: self.key.setEchoMode(QLineEdit.Normal if on else QLineEdit.Password))
        self.openai_url = QLineEdit(readOnly=True)
        self.anthropic_url = QLineEdit(readOnly=True)
        key_row = _copy_row(self.key)
        key_row.layout().insertWidget(1, self.show_key)
        af.addRow("Server URL", _copy_row(self.url))
        af.addRow("API key", key_row)
        af.addRow("OpenAI base URL", _copy_row(self.openai_url))
        af.addRow("Anthropic base URL", _copy_row(self.anthropic_url))
        self.example = QPlainTextEdit(readOnly=True)
        self.example.setMaximumHeight(90)
        ex_copy = QPushButton("Copy example")
        ex_copy.clicked.connect(lambda: QGuiApplication.clipboard().setText(self._example(reveal=True)))
        self.show_key.toggled.connect(lambda _on: self.example.setPlainText(self._example()))
        af.addRow("Example", self.example)
        af.addRow("", ex_copy)
        note = QLabel("The server listens on this computer only (127.0.0.1) on a free port chosen at each start; "
                      "the key is kept in your config folder, readable by you only.")
        note.setWordWrap(True)
        af.addRow(note)

        # ---- engine options ----
        eng = QGroupBox("Engine options (saved in the preset; applied at the next engine start)")
        ef = QFormLayout(eng)
        self.preset_label = QLabel()
        ef.addRow("Preset", self.preset_label)
        self.fields: dict[str, QWidget] = {}
        for name, field in FIELDS.items():
            if name in APP_MANAGED:
                continue
            if name in CHOICES:
                w: QWidget = QComboBox()
                w.addItems(list(CHOICES[name]))
            else:
                w = QLineEdit()
                w.setPlaceholderText(_default_text(name))
            w.setToolTip(f"{flag(name)}{' / ' + field.short if field.short else ''}: {field.help}")
            if name == "model":
                row = QWidget()
                rl = QHBoxLayout(row)
                rl.setContentsMargins(0, 0, 0, 0)
                browse = QToolButton(text="Browse\u2026")
                browse.clicked.connect(self._browse)
                rl.addWidget(w, 1)
                rl.addWidget(browse)
                ef.addRow(field.label, row)
            else:
                ef.addRow(field.label, w)
            self.fields[name] = w
        self.error = QLabel()
        self.error.setObjectName("settingsError")
        self.error.setWordWrap(True)
        self.error.setStyleSheet("color: #d04040")
        self.apply_btn = QPushButton("Save and restart the engine")
        self.apply_btn.clicked.connect(self._apply)
        ef.addRow(self.error)
        ef.addRow("", self.apply_btn)

        inner = QWidget()
        lay = QVBoxLayout(inner)
        lay.addWidget(api)
        lay.addWidget(eng)
        lay.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(inner)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(scroll)
        self._base_url: str | None = None
        self._api_key: str | None = None
        self.set_server(None, None)

    def set_server(self, base_url: str | None, api_key: str | None) -> None:
        self.url.setText(base_url or "(engine not running)")
        self.key.setText(api_key or "")
        self.key.setProperty("secret", api_key or "")
        self.openai_url.setText(openai_base_url(base_url) if base_url else "")
        self.anthropic_url.setText(anthropic_base_url(base_url) if base_url else "")
        self._base_url, self._api_key = base_url, api_key
        self.example.setPlainText(self._example())

    def _example(self, reveal: bool = False) -> str:
        """A working client snippet; the key shows only when revealed (Show) or copied."""
        if not self._base_url:
            return ""
        key = self._api_key if (reveal or self.show_key.isChecked()) else "\u2022" * 8 + " (Show or Copy reveals it)"
        return (f"from openai import OpenAI\nclient = OpenAI(base_url=\"{openai_base_url(self._base_url)}\", "
                f"api_key=\"{key}\")\nprint(client.chat.completions.create(model=\"local\", messages=[{{\"role\": "
                "\"user\", \"content\": \"Hello\"}]).choices[0].message.content)")

    def set_config(self, cfg: Config | None, preset: str | None) -> None:
        self.preset_label.setText(preset or "(none yet: run the setup wizard)")
        cfg = cfg or Config()
        for name, w in self.fields.items():
            value = getattr(cfg, name)
            if isinstance(w, QComboBox):
                w.setCurrentText(str(value))
            else:
                default = getattr(Config(), name)
                w.setText("" if value is None or value == default else str(value))

    def config(self) -> Config:
        """The form as a Config (raises UserError naming the bad field)."""
        values: dict[str, Any] = {}
        for name, w in self.fields.items():
            text = w.currentText() if isinstance(w, QComboBox) else w.text().strip()
            if text != "":
                values[name] = text
        return Config(**values)

    def _apply(self) -> None:
        try:
            cfg = self.config()
        except UserError as e:
            self.error.setText(str(e))
            return
        if not cfg.model:
            self.error.setText("model: choose a GGUF file")
            return
        self.error.setText("")
        self.applyRequested.emit(cfg)

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Choose a GGUF model", "", "GGUF models (*.gguf);;All files (*)")
        if path:
            self.fields["model"].setText(path)


def _default_text(name: str) -> str:
    default = getattr(Config(), name)
    if default is None:
        return {"threads": "auto (physical cores)", "model": "path to a .gguf file"}.get(name, "not set")
    return f"{default} (default)"
