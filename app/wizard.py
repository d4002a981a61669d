"""The setup wizard: hardware, model, memory plan, summary. First run and Engine > Setup.

It talks to the engine's planner through app/plan_service.py (a helper process), so the
plan it shows is exactly `moestudio plan --json`, re-priced live as values change. The result
is a named preset (TOML, engine/config.py's schema) that `moestudio serve --preset` reads too.
"""
from __future__ import annotations


import re
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (QCheckBox, QComboBox, QFileDialog, QFormLayout, QHBoxLayout,
                               QHeaderView, QLabel, QLineEdit, QListWidget, QMessageBox, QPlainTextEdit,
                               QProgressBar, QPushButton, QSpinBox, QTableWidget, QTableWidgetItem,
                               QVBoxLayout, QWidget, QWizard, QWizardPage)

from engine.config import ENGINES, FIELDS, Config, to_toml

from app.plan_service import PlanService
from app.settings_panel import FractionEditor

MIB = 1 << 20


ENGINE_NAMES = {"hybrid": "the MoE Studio hybrid engine", "llamacpp": "llama.cpp"}


def engine_sentence(kind: str, reason: str) -> str:
    """One sentence: what runs the model on this machine, and why (the server's own choice and
    reason, from the planner helper: engine/server/loader.choose_engine)."""
    name = f"<b>{ENGINE_NAMES.get(kind, kind)}</b>"
    if reason.startswith("auto: "):
        return f"On this machine {name} will run it (engine auto): {reason.removeprefix('auto: ')}."
    return f"On this machine {name} will run it: {reason}."


def _rate(v: float) -> str:
    return f"{v:,.0f}" if v >= 10 else f"{v:,.1f}"


def decode_figure(dec: dict) -> str:
    """The plan table's cell: the measured rate, or the estimate marked as one (engine/plan/speed.py)."""
    if dec["source"] == "measured":
        return f"{_rate(dec['tokens_per_s'])} tok/s measured"
    est = dec["estimate"]
    return f"~{_rate(est['tokens_per_s'])} tok/s ({_rate(est['low'])}–{_rate(est['high'])})"


def decode_sentence(dec: dict) -> str:
    """The summary's words for the plan's decode speed: measured here, or an estimate with its range."""
    est = dec["estimate"]
    if dec["source"] == "measured":
        return (f"<b>{_rate(dec['tokens_per_s'])} tokens/s</b>, measured on this machine with these settings "
                f"(the estimate was ~{_rate(est['tokens_per_s'])})")
    return (f"about <b>{_rate(est['tokens_per_s'])} tokens/s</b> (an estimate: {_rate(est['low'])}–"
            f"{_rate(est['high'])}; the measured rate replaces it once the engine has run this model here)")


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return ""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / MIB:,.1f} MiB"


class HardwarePage(QWizardPage):
    def __init__(self, service: PlanService):
        super().__init__()
        self.service = service
        self.setTitle("Your hardware")
        self.setSubTitle("What the engine can use: the GPU (through NVML), system RAM and CPU cores.")
        self.info = QLabel("Reading the hardware (starting the planner)\u2026")
        self.info.setWordWrap(True)
        self.info.setTextFormat(Qt.RichText)
        lay = QVBoxLayout(self)
        lay.addWidget(self.info)
        lay.addStretch(1)
        self.hardware: dict | None = None

    def initializePage(self) -> None:
        if self.hardware is None:
            self.service.request("probe", self._show, self._failed)

    def _show(self, hw: dict) -> None:
        self.hardware = hw
        self.wizard().hardware = hw
        rows = []
        if hw["gpus"]:
            for i, g in enumerate(hw["gpus"]):
                pcie = (f"PCIe gen {g['pcie_generation']} x{g['pcie_width']}" if g.get("pcie_generation")
                        else "PCIe link unknown")
                rows.append(f"<b>GPU {i}</b>: {g['name']}: {fmt_bytes(g['total_bytes'])} VRAM, "
                            f"{fmt_bytes(g['free_bytes'])} free; {pcie}")
        else:
            rows.append("<b>No NVIDIA GPU found</b> (or no driver): the engine runs on the CPU. "
                        "It works, only slower.")
        read = (f"; reads {hw['ram_read_gbs']:g} GB/s on every core, {hw['ram_read_gbs_1']:g} on one (measured)"
                if hw.get("ram_read_gbs") else "")
        rows.append(f"<b>RAM</b>: {fmt_bytes(hw['ram_total_bytes'])}, {fmt_bytes(hw['ram_available_bytes'])} available"
                    + read)
        rows.append(f"<b>CPU</b>: {hw['physical_cores']} physical cores, {hw['logical_cores']} logical")
        self.info.setText("<br><br>".join(rows))
        self.completeChanged.emit()

    def _failed(self, error: str) -> None:
        self.info.setText(f"Could not read the hardware: {error}")

    def isComplete(self) -> bool:
        return self.hardware is not None


class ModelPage(QWizardPage):
    def __init__(self, service: PlanService, recent: list[str]):
        super().__init__()
        self.service = service
        self.setTitle("Model")
        self.setSubTitle("A GGUF Mixture-of-Experts model. No model yet? The demo model is a small random-weight "
                         "Qwen3-MoE: it runs anywhere and shows everything, but its replies are gibberish.")
        self.path = QLineEdit(placeholderText="/path/to/model.gguf")
        browse = QPushButton("Open GGUF\u2026")
        self.demo_btn = QPushButton("Use the demo model")
        self.demo_progress = QProgressBar()
        self.demo_progress.setVisible(False)
        self.recent = QListWidget()
        self.recent.addItems([r for r in recent if Path(r).exists()])
        self.recent.setMaximumHeight(100)
        self.recent_label = QLabel("Recent models:")
        self.recent_label.setVisible(self.recent.count() > 0)
        self.recent.setVisible(self.recent.count() > 0)
        self.details = QLabel()
        self.details.setWordWrap(True)
        self.details.setTextFormat(Qt.RichText)
        self.details.setAlignment(Qt.AlignTop | Qt.AlignLeft)
        row = QHBoxLayout()
        row.addWidget(self.path, 1)
        row.addWidget(browse)
        lay = QVBoxLayout(self)
        lay.addLayout(row)
        demo_row = QHBoxLayout()
        demo_row.addWidget(self.demo_btn)
        demo_row.addWidget(self.demo_progress, 1)
        lay.addLayout(demo_row)
        lay.addWidget(self.recent_label)
        lay.addWidget(self.recent)
        lay.addSpacing(12)
        lay.addWidget(self.details, 1)
        self.info: dict | None = None
        self._rid: int | None = None
        self._debounce = QTimer(self, singleShot=True, interval=300)
        self._debounce.timeout.connect(self._inspect)
        browse.clicked.connect(self._browse)
        self.demo_btn.clicked.connect(self.use_demo)
        self.recent.itemClicked.connect(lambda item: self.path.setText(item.text()))
        self.path.textChanged.connect(self._path_changed)

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a GGUF model", str(Path.home()),
                                              "GGUF models (*.gguf);;All files (*)")
        if path:
            self.path.setText(path)

    def use_demo(self) -> None:
        self.demo_btn.setEnabled(False)
        self.demo_progress.setVisible(True)
        self.demo_progress.setRange(0, 0)
        self.details.setText("Writing the demo model (once; about 60 MB)\u2026")

        def progress(p: list) -> None:
            done, total = int(p[0]), max(int(p[1]), 1)
            self.demo_progress.setRange(0, 1000)
            self.demo_progress.setValue(int(1000 * done / total))

        def done(path: str) -> None:
            self.demo_btn.setEnabled(True)
            self.demo_progress.setVisible(False)
            self.path.setText(path)

        def failed(err: str) -> None:
            self.demo_btn.setEnabled(True)
            self.demo_progress.setVisible(False)
            self.details.setText(f"<b>Could not write the demo model:</b> {err}")

        self.service.request("demo", done, failed, progress)

    def _path_changed(self, _t: str) -> None:
        self.info = None
        self.completeChanged.emit()
        self._debounce.start()

    def _inspect(self) -> None:
        path = self.path.text().strip()
        if self._rid is not None:
            self.service.forget(self._rid)
        if not path:
            self.details.setText("")
            return
        if not Path(path).is_file():
            self.details.setText("<b>No such file.</b>")
            return
        self.details.setText("Reading the model header\u2026")
        self._rid = self.service.request("model_info", lambda info, p=path: self._show(p, info),
                                         lambda err: self.details.setText(f"<b>Cannot use this file:</b> {err}"),
                                         model=path)

    def _show(self, path: str, info: dict) -> None:
        if path != self.path.text().strip():
            return
        self.info = info
        g = info["geometry"]
        types = ", ".join(f"{k} \u00d7{v}" for k, v in info["quant_types"].items())
        expert_types = ", ".join(info["expert_quant_types"]) or "none"
        self.details.setText(
            f"<b>{g['name']}</b> \u2014 {fmt_bytes(g['file_bytes'])}<br>"
            f"architecture <b>{g['arch']}</b>, {g['n_layer']} layers ({len(g['moe_layers'])} MoE), "
            f"{g['n_expert']} experts per layer, {g['n_expert_used']} active per token, "
            f"training context {g['n_ctx_train']:,}<br>"
            f"expert quantization: {expert_types}; all tensors: {types}<br>"
            f"one expert: {fmt_bytes(g['expert_bytes'])}; all experts: {fmt_bytes(g['experts_bytes_total'])}; "
            f"dense weights: {fmt_bytes(g['dense_bytes'])}<br>"
            f"{engine_sentence(info['engine'], info['engine_reason'])}")
        self.wizard().model_info = info
        self.completeChanged.emit()

    def isComplete(self) -> bool:
        return self.info is not None

    def model_path(self) -> str:
        return self.path.text().strip()


class PlanPage(QWizardPage):
    def __init__(self, service: PlanService):
        super().__init__()
        self.service = service
        self.setTitle("Memory plan")
        self.setSubTitle("Where each part of the model goes. Change a value and the plan is re-priced at once.")
        self.engine = QComboBox()
        self.engine.addItems(list(ENGINES))
        self.ctx = QSpinBox(minimum=256, maximum=1 << 20, singleStep=1024)
        self.cache_auto = QCheckBox("auto")
        self.cache_auto.setChecked(True)
        self.cache = QSpinBox(minimum=0, maximum=4096)
        self.threads_auto = QCheckBox("auto")
        self.threads_auto.setChecked(True)
        self.threads = QSpinBox(minimum=1, maximum=1024)
        self.miss = FractionEditor()  # Settings' own widget: the same words and the same auto
        self.engine_note = QLabel()  # what the chosen engine setting runs on this machine, and why
        self.engine_note.setWordWrap(True)
        self.engine_note.setTextFormat(Qt.RichText)
        self.engine_note.setObjectName("planEngineNote")
        form = QFormLayout()
        form.addRow(FIELDS["engine"].label, self.engine)
        form.addRow("", self.engine_note)
        form.addRow(FIELDS["ctx"].label, self.ctx)
        form.addRow(FIELDS["moe_expert_cache_size"].label, _pair(self.cache, self.cache_auto))
        form.addRow(FIELDS["threads"].label, _pair(self.threads, self.threads_auto))
        form.addRow(FIELDS["moe_gpu_miss_fraction"].label, self.miss)
        self.table = QTableWidget(0, 4)
        self.table.setHorizontalHeaderLabels(["", "size", "where", "why"])
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(3, QHeaderView.Stretch)
        self.table.setEditTriggers(QTableWidget.NoEditTriggers)
        self.table.setWordWrap(True)
        self.summary = QLabel()
        self.summary.setWordWrap(True)
        self.warnings = QLabel()
        self.warnings.setWordWrap(True)
        self.warnings.setObjectName("planWarnings")
        self.warnings.setStyleSheet("color: #d04040")
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(self.table, 1)
        lay.addWidget(self.summary)
        lay.addWidget(self.warnings)
        self.plan: dict | None = None
        self.reprices = 0
        self.assume_gpu_mib: int | None = None  # plan for an assumed GPU (`moestudio plan --assume-gpu-mib`)
        self._rid: int | None = None
        self._debounce = QTimer(self, singleShot=True, interval=120)
        self._debounce.timeout.connect(self._reprice)
        for w in (self.ctx, self.cache, self.threads):
            w.valueChanged.connect(self._changed)
        self.engine.currentTextChanged.connect(self._changed)
        self.miss.changed.connect(self._changed)
        for cb, spin in ((self.cache_auto, self.cache), (self.threads_auto, self.threads)):
            cb.toggled.connect(lambda on, s=spin: (s.setEnabled(not on), self._changed()))
            spin.setEnabled(False)
        self._model: str | None = None

    def initializePage(self) -> None:
        wiz = self.wizard()
        info = wiz.model_info
        model = wiz.model_page.model_path()
        if model != self._model:
            self._model = model
            g = info["geometry"]
            self.ctx.blockSignals(True)
            self.ctx.setMaximum(max(256, g["n_ctx_train"] or 1 << 20))
            self.ctx.setValue(min(4096, g["n_ctx_train"] or 4096))
            self.ctx.blockSignals(False)
            self.cache.setMaximum(g["n_expert"])
            hw = wiz.hardware or {}
            self.threads.setValue(hw.get("physical_cores", 1))
        self._reprice()

    def _changed(self, *_a) -> None:
        self._debounce.start()

    def _reprice(self) -> None:
        if self._rid is not None:
            self.service.forget(self._rid)  # only the newest answer matters
        self._rid = self.service.request("plan", self._show, self._failed, model=self._model,
                                         settings=self.config_values(), assume_gpu_mib=self.assume_gpu_mib)

    def _failed(self, err: str) -> None:
        self.plan = None
        self.engine_note.setText("")
        self.warnings.setText(f"The planner refused these values: {err}")
        self.completeChanged.emit()

    def _show(self, plan: dict) -> None:
        self._rid = None
        self.plan = plan
        self.reprices += 1
        self.engine_note.setText(engine_sentence(plan["engine"], plan["engine_reason"]))
        lines = plan["lines"]
        self.table.setRowCount(len(lines))
        for r, line in enumerate(lines):
            figure = fmt_bytes(line["bytes"]) if line["bytes"] is not None else str(line["value"])
            if line["name"] == "expert cache" and line.get("value") is not None:
                figure = f"{line['value']} slots, {fmt_bytes(line['bytes'])}"
            elif line["name"] == "decode speed" and line.get("value") is not None:
                figure = decode_figure(plan["decode"])
            for c, text in enumerate((line["name"], figure, line["where"], line["explain"])):
                item = QTableWidgetItem(text)
                item.setToolTip(text)
                self.table.setItem(r, c, item)
        self.table.resizeColumnsToContents()
        self.table.horizontalHeader().setSectionResizeMode(3, QHeaderView.Stretch)
        self.table.resizeRowsToContents()
        # An "auto" field shows the value the plan picked for it.
        if self.cache_auto.isChecked():
            self.cache.blockSignals(True)
            self.cache.setValue(int(plan["expert_cache"]["slots_per_layer"]))
            self.cache.blockSignals(False)
        fraction = next((line for line in lines if line["name"] == "miss fraction"), None)
        self.miss.show_auto(fraction["value"] if fraction else None, fraction["explain"] if fraction else "")
        self.summary.setText(f"Plan: <b>{plan['mode'].upper()}</b>; decode {decode_sentence(plan['decode'])}. "
                             + ("Fits." if plan["fits"] else "<b>Does not fit.</b>"))
        self.warnings.setText("<br>".join(f"\u26a0 {w}" for w in plan["warnings"]))
        self.completeChanged.emit()

    def isComplete(self) -> bool:
        return self.plan is not None

    def validatePage(self) -> bool:
        if self.plan and not self.plan["fits"]:
            answer = QMessageBox.warning(
                self, "This plan does not fit",
                "The plan needs more memory than this machine has:\n\n" + "\n".join(self.plan["warnings"]) +
                "\n\nThe engine will probably fail to load or run very slowly. Continue anyway?",
                QMessageBox.Yes | QMessageBox.No, QMessageBox.No)
            return answer == QMessageBox.Yes
        return True

    def config_values(self) -> dict[str, Any]:
        """The settings of these widgets (engine/config.Config fields): what the plan is priced for
        and what the preset saves; a field left on auto is left out, so the engine decides."""
        v: dict[str, Any] = {"engine": self.engine.currentText(), "ctx": self.ctx.value()}
        if not self.cache_auto.isChecked():
            v["moe_expert_cache_size"] = self.cache.value()
        if not self.threads_auto.isChecked():
            v["threads"] = self.threads.value()
        if self.miss.value() != "auto":
            v["moe_gpu_miss_fraction"] = self.miss.value()
        return v


class SummaryPage(QWizardPage):
    def __init__(self):
        super().__init__()
        self.setTitle("Summary")
        self.setSubTitle("These settings are saved as a named preset; Finish starts the engine with them. "
                         "`moestudio serve --preset NAME` uses the same preset.")
        self.name = QLineEdit()
        self.preview = QPlainTextEdit(readOnly=True)
        self.start = QCheckBox("Start the engine now")
        self.start.setChecked(True)
        self.error = QLabel()
        self.error.setStyleSheet("color: #d04040")
        form = QFormLayout(self)
        form.addRow("Preset name", self.name)
        form.addRow("Settings", self.preview)
        form.addRow("", self.start)
        form.addRow(self.error)
        self.name.textChanged.connect(lambda _t: self.completeChanged.emit())

    def initializePage(self) -> None:
        wiz = self.wizard()
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(wiz.model_page.model_path()).stem).strip("-.")[:48] or "default"
        if not self.name.text():
            self.name.setText(stem)
        self.preview.setPlainText(to_toml({k: v for k, v in wiz.config_values().items()}))

    def isComplete(self) -> bool:
        return bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", self.name.text()))


def _pair(spin: QWidget, check: QCheckBox) -> QWidget:
    w = QWidget()
    lay = QHBoxLayout(w)
    lay.setContentsMargins(0, 0, 0, 0)
    lay.addWidget(spin, 1)
    lay.addWidget(check)
    return w


class SetupWizard(QWizard):
    """Emits `finishedWith(preset_name, Config, start)` when the user finishes."""

    finishedWith = Signal(str, object, bool)

    def __init__(self, service: PlanService, recent: list[str], parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("MoE Studio setup")
        self.setWizardStyle(QWizard.ClassicStyle)
        self.setOption(QWizard.NoBackButtonOnStartPage, True)
        self.service = service
        self.hardware: dict | None = None
        self.model_info: dict | None = None
        self.hardware_page = HardwarePage(service)
        self.model_page = ModelPage(service, recent)
        self.plan_page = PlanPage(service)
        self.summary_page = SummaryPage()
        for page in (self.hardware_page, self.model_page, self.plan_page, self.summary_page):
            self.addPage(page)
        self.resize(860, 640)
        service.start()  # the planner imports while the user reads the first page

    def config_values(self) -> dict[str, Any]:
        return {"model": self.model_page.model_path(), **self.plan_page.config_values()}

    def config(self) -> Config:
        return Config(**self.config_values())

    def accept(self) -> None:
        self.finishedWith.emit(self.summary_page.name.text(), self.config(), self.summary_page.start.isChecked())
        super().accept()
