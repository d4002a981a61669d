"""The Settings tab: every engine option of the current preset, each as a typed widget built from
the option's `Domain` in engine/config.py (bounds and choices are defined there, once): spin
boxes, combo boxes, "auto" boxes. Values the model limits (the context up to its training length,
expert slots up to its expert count) are bounded by the model's header, and a preset value beyond
them is shown clamped with a message. Beside each option: what the running engine uses
(/health's `effective`). The API server's address and key are the API tab's (app/api_panel.py)."""
from __future__ import annotations


from typing import Any

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QGroupBox,
                               QHBoxLayout, QLabel, QLineEdit, QPushButton, QScrollArea, QSpinBox, QToolButton,
                               QVBoxLayout, QWidget)

from engine.config import FIELDS, Config, Domain, flag
from engine.errors import UserError

from app.settings import ModelLimits, check_for_model, model_limits

APP_MANAGED = ("host", "port", "api_key")  # the API tab sets them for the app (app/api_panel.py)
INT_MAX = (1 << 31) - 1
# What the lowest value of an optional number's spin box stands for (the setting left unset).
UNSET_TEXT = {"threads": "auto (physical cores)", "moe_expert_cache_mib": "not set (slots decide)",
              "vram_budget_mib": "not set (the free VRAM)", "ctx": "the model's training length"}


class Editor(QWidget):
    """One setting's widget: `value()` is what goes into a Config (None: not set)."""

    changed = Signal()

    def value(self) -> Any:
        raise NotImplementedError

    def set_value(self, value: Any) -> None:
        raise NotImplementedError


def _row(*widgets: QWidget) -> QHBoxLayout:
    lay = QHBoxLayout()
    lay.setContentsMargins(0, 0, 0, 0)
    for w in widgets:
        lay.addWidget(w)
    return lay


class ChoiceEditor(Editor):
    def __init__(self, domain: Domain, editable: bool = False):
        super().__init__()
        self.combo = QComboBox(editable=editable)
        self.combo.addItems(list(domain.options))
        self.combo.currentTextChanged.connect(lambda _t: self.changed.emit())
        self.setLayout(_row(self.combo))

    def value(self) -> Any:
        return self.combo.currentText().strip()

    def set_value(self, value: Any) -> None:
        self.combo.setCurrentText(str(value))


class IntEditor(Editor):
    """A spin box over the domain's range; an optional setting (default None) gets one more value
    below the range that stands for "not set" (shown as UNSET_TEXT)."""

    def __init__(self, name: str, domain: Domain, default: Any):
        super().__init__()
        self.optional = default is None
        self.default = default
        self.spin = QSpinBox()
        self.spin.setRange(domain.lo - (1 if self.optional else 0), INT_MAX if domain.hi is None else domain.hi)
        self.spin.setGroupSeparatorShown(True)
        if self.optional or name in UNSET_TEXT:
            self.spin.setSpecialValueText(UNSET_TEXT.get(name, "not set"))
        self.spin.valueChanged.connect(lambda _v: self.changed.emit())
        self.setLayout(_row(self.spin))

    def value(self) -> Any:
        v = self.spin.value()
        return None if self.optional and v == self.spin.minimum() else v

    def set_value(self, value: Any) -> None:
        self.spin.setValue(self.spin.minimum() if value is None else int(value))


class WordOrIntEditor(Editor):
    """One of the domain's words (auto, all...) or a number."""

    NUMBER = "number"

    def __init__(self, domain: Domain):
        super().__init__()
        self.combo = QComboBox()
        self.combo.addItems([*domain.options, self.NUMBER])
        self.spin = QSpinBox()
        self.spin.setRange(domain.lo or 0, INT_MAX)
        self.combo.currentTextChanged.connect(self._mode)
        self.spin.valueChanged.connect(lambda _v: self.changed.emit())
        self.setLayout(_row(self.combo, self.spin))
        self._mode(self.combo.currentText())

    def _mode(self, text: str) -> None:
        self.spin.setEnabled(text == self.NUMBER)
        self.changed.emit()

    def value(self) -> Any:
        return self.spin.value() if self.combo.currentText() == self.NUMBER else self.combo.currentText()

    def set_value(self, value: Any) -> None:
        if isinstance(value, int):
            self.spin.setValue(value)
            self.combo.setCurrentText(self.NUMBER)
        else:
            self.combo.setCurrentText(str(value))


class FractionEditor(Editor):
    """The miss fraction: a number, or auto. The one widget for it (Settings and the wizard's plan
    page), so both say the same: on auto its number is what auto comes to, as `show_auto` is told
    (the plan's estimate before the engine runs, the engine's measured value while it runs)."""

    NOT_APPLICABLE = "does not apply"

    def __init__(self) -> None:
        super().__init__()
        self.auto = QCheckBox("auto (measured at load)")
        self.spin = QDoubleSpinBox(minimum=0.0, maximum=1.0, singleStep=0.05, decimals=3)
        self.auto.toggled.connect(self._toggled)
        self.spin.valueChanged.connect(lambda _v: self.changed.emit())
        self.setLayout(_row(self.spin, self.auto))
        self.auto.setChecked(True)
        self.spin.setEnabled(False)

    def _toggled(self, on: bool) -> None:
        self.spin.setEnabled(not on)
        if not on:  # a number of the user's: 0 means 0
            self.spin.setSpecialValueText("")
            self.spin.setToolTip("")
        self.changed.emit()

    def show_auto(self, value: float | None, why: str = "") -> None:
        """On auto, show what auto comes to: `value`, or None where the setting does not apply
        (no GPU to upload to, or llama.cpp, which has no expert cache); `why` as the tooltip."""
        if not self.auto.isChecked():
            return
        self.spin.blockSignals(True)
        self.spin.setSpecialValueText(self.NOT_APPLICABLE if value is None else "")
        self.spin.setValue(self.spin.minimum() if value is None else float(value))
        self.spin.blockSignals(False)
        self.spin.setToolTip(why)

    def value(self) -> Any:
        return "auto" if self.auto.isChecked() else round(self.spin.value(), 4)

    def set_value(self, value: Any) -> None:
        self.auto.setChecked(value == "auto")
        if value != "auto":
            self.spin.setValue(float(value))


class FileEditor(Editor):
    def __init__(self, placeholder: str, title: str, patterns: str):
        super().__init__()
        self.line = QLineEdit(placeholderText=placeholder)
        browse = QToolButton(text="Browse\u2026")
        browse.clicked.connect(lambda: self._browse(title, patterns))
        self.line.editingFinished.connect(self.changed.emit)
        self.setLayout(_row(self.line, browse))
        self.layout().setStretch(0, 1)

    def _browse(self, title: str, patterns: str) -> None:
        path, _ = QFileDialog.getOpenFileName(self, title, "", patterns)
        if path:
            self.set_value(path)
            self.changed.emit()

    def value(self) -> Any:
        return self.line.text().strip() or None

    def set_value(self, value: Any) -> None:
        self.line.setText("" if value is None else str(value))


class TextEditor(Editor):
    def __init__(self) -> None:
        super().__init__()
        self.line = QLineEdit()
        self.line.editingFinished.connect(self.changed.emit)
        self.setLayout(_row(self.line))

    def value(self) -> Any:
        return self.line.text().strip() or None

    def set_value(self, value: Any) -> None:
        self.line.setText("" if value is None else str(value))


def make_editor(name: str) -> Editor:
    """The widget for one setting, from its domain in engine/config.py."""
    domain, default = FIELDS[name].domain, getattr(Config(), name)
    if domain.kind == "choice":
        return ChoiceEditor(domain)
    if domain.kind == "device":
        return ChoiceEditor(domain, editable=True)  # cuda:N typed in; checked by the schema on save
    if domain.kind == "int":
        return IntEditor(name, domain, default)
    if domain.kind == "word_or_int":
        return WordOrIntEditor(domain)
    if domain.kind == "fraction":
        return FractionEditor()
    if domain.kind == "file":
        if name == "model":
            return FileEditor("path to a .gguf file", "Choose a GGUF model", "GGUF models (*.gguf);;All files (*)")
        return FileEditor("not set", "Choose a file", "GGUF or STRP profiles (*.gguf *.strp);;All files (*)")
    return TextEditor()


class SettingsPanel(QWidget):
    applyRequested = Signal(object)  # Config: save to the current preset and restart the engine

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        eng = QGroupBox("Engine options (saved in the preset; applied at the next engine start)")
        ef = QFormLayout(eng)
        self.preset_label = QLabel()
        ef.addRow("Preset", self.preset_label)
        self.fields: dict[str, Editor] = {}
        self.effective: dict[str, QLabel] = {}  # what the running engine uses, beside each option
        for name, field in FIELDS.items():
            if name in APP_MANAGED:
                continue
            editor = make_editor(name)
            editor.setToolTip(f"{flag(name)}{' / ' + field.short if field.short else ''}: {field.help}")
            used = QLabel()
            used.setObjectName(f"effective_{name}")
            used.setStyleSheet("color: gray")  # a note beside the value, not a value
            used.setTextInteractionFlags(Qt.TextSelectableByMouse)
            row = QWidget()
            rl = QHBoxLayout(row)
            rl.setContentsMargins(0, 0, 0, 0)
            rl.addWidget(editor, 1)
            rl.addWidget(used)
            ef.addRow(field.label, row)
            self.fields[name], self.effective[name] = editor, used
        # The model's limits, and any preset value they clamped (visible, never silent).
        self.model_note = QLabel()
        self.model_note.setObjectName("settingsModelNote")
        self.model_note.setWordWrap(True)
        ef.addRow(self.model_note)
        self.engine_note = QLabel()  # which engine runs, and why (from /health)
        self.engine_note.setObjectName("settingsEngineNote")
        self.engine_note.setWordWrap(True)
        ef.addRow(self.engine_note)
        self.limits: ModelLimits | None = None
        self.fields["model"].changed.connect(self._model_changed)

        self.error = QLabel()
        self.error.setObjectName("settingsError")
        self.error.setWordWrap(True)
        self.error.setStyleSheet("color: #d04040")
        self.apply_btn = QPushButton("Save and restart the engine")
        self.apply_btn.clicked.connect(self._apply)

        inner = QWidget()
        lay = QVBoxLayout(inner)
        lay.addWidget(eng)
        lay.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(inner)
        # Save stays visible below the scrolled options, whatever the window's height.
        bar = QHBoxLayout()
        bar.addWidget(self.error, 1)
        bar.addWidget(self.apply_btn, 0, Qt.AlignRight | Qt.AlignTop)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(scroll, 1)
        outer.addLayout(bar)

    def set_config(self, cfg: Config | None, preset: str | None) -> None:
        self.preset_label.setText(preset or "(none yet: run the setup wizard)")
        cfg = cfg or Config()
        self.fields["model"].set_value(cfg.model)
        self._read_limits(cfg.model)  # bounds first, so a value beyond them is seen being clamped
        for name, editor in self.fields.items():
            if name != "model":
                editor.set_value(getattr(cfg, name))
        self.model_note.setText(self._limits_text(check_for_model(cfg, self.limits)))

    def config(self) -> Config:
        """The form as a Config (raises UserError naming the bad field)."""
        values = {name: editor.value() for name, editor in self.fields.items()}
        return Config(**{k: v for k, v in values.items() if v is not None})

    def set_effective(self, health: dict | None) -> None:
        """What the running engine uses (/health's `effective`, by setting name); cleared when none runs."""
        effective = (health or {}).get("effective") or {}
        for name, label in self.effective.items():
            value = effective.get(name)
            label.setText("" if value is None else f"engine: {_shown(name, value)}")
        fraction = self.fields["moe_gpu_miss_fraction"]
        if isinstance(fraction, FractionEditor) and effective:
            # on auto, the number is the engine's (absent: llama.cpp, where it does not apply)
            fraction.show_auto(effective.get("moe_gpu_miss_fraction"), "what the running engine uses")
        if health and health.get("engine"):
            self.engine_note.setText(f"Running: {health['engine']} engine ({health.get('engine_reason') or ''})")
        else:
            self.engine_note.setText("")

    # ---- the model's limits ----------------------------------------------------------------
    def _read_limits(self, model: str | None) -> None:
        self.limits = model_limits(model)
        ctx = self.fields["ctx"]
        assert isinstance(ctx, IntEditor)
        ctx.spin.setMaximum(self.limits.n_ctx_train if self.limits and self.limits.n_ctx_train else INT_MAX)
        cache = self.fields["moe_expert_cache_size"]
        assert isinstance(cache, WordOrIntEditor)
        cache.spin.setMaximum(self.limits.n_expert if self.limits and self.limits.n_expert else INT_MAX)

    def _model_changed(self) -> None:
        before = self._current_values()
        self._read_limits(self.fields["model"].value())
        self.model_note.setText(self._limits_text(check_for_model(before, self.limits)))

    def _current_values(self) -> Config:
        try:
            return self.config()
        except UserError:
            return Config()

    def _limits_text(self, problem: str | None) -> str:
        if self.limits is None:
            return ""
        parts = [f"This model: trained context {self.limits.n_ctx_train:,} tokens"
                 if self.limits.n_ctx_train else "This model states no training context",
                 f"{self.limits.n_expert} experts per layer" if self.limits.n_expert else ""]
        text = "; ".join(p for p in parts if p) + "."
        return f"{text} In the preset: {problem}. The form shows the value clamped; Save writes it." if problem else text

    def _apply(self) -> None:
        try:
            cfg = self.config()
        except UserError as e:
            self.error.setText(str(e))
            return
        if not cfg.model:
            self.error.setText("model: choose a GGUF file")
            return
        if self.limits is None or self.limits.path != cfg.model:
            self._read_limits(cfg.model)
        problem = check_for_model(cfg, self.limits)
        if problem:  # only when the bounds were not known as the value was typed
            self.error.setText(problem)
            return
        self.error.setText("")
        self.applyRequested.emit(cfg)


def _shown(name: str, value: Any) -> str:
    if name == "moe_expert_cache_size":
        return f"{value} slots per layer"
    if name == "moe_gpu_miss_fraction":
        return f"{float(value):.3g}"
    if name == "ctx":
        return f"{int(value):,} tokens"
    return str(value)
