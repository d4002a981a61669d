"""The Settings tab: every engine option of the current preset (engine/config.py's schema, one
field per option). The API server's address and key are the API tab's (app/api_panel.py)."""
from __future__ import annotations


from typing import Any

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QComboBox, QFileDialog, QFormLayout, QGroupBox, QHBoxLayout, QLabel, QLineEdit,
                               QPushButton, QScrollArea, QToolButton, QVBoxLayout, QWidget)

from engine.config import ENGINES, FIELDS, LOAD_MODES, POLICIES, Config, flag
from engine.errors import UserError


APP_MANAGED = ("host", "port", "api_key")  # the API tab sets them for the app (app/api_panel.py)
CHOICES = {"engine": ENGINES, "moe_profile_adapt": POLICIES, "load_mode": LOAD_MODES}


class SettingsPanel(QWidget):
    applyRequested = Signal(object)  # Config: save to the current preset and restart the engine

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
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
        lay.addWidget(eng)
        lay.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(inner)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(scroll)

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
