"""The Models tab: the model library (app/library.py) as a table, with what fits this machine.

"Fits" is the planner's verdict for the model at the default options (the wizard's plan page
prices other ones), asked of the planner helper (app/plan_service.py) one model at a time; the
helper starts when the tab first lists models. Choosing a model ("Use this model", a double
click, or the chat header's picker) asks the main window to restart the engine on it.
"""
from __future__ import annotations


import time
from pathlib import Path

from PySide6.QtCore import Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (QAbstractItemView, QFileDialog, QHBoxLayout, QHeaderView, QLabel, QPushButton,
                               QTableWidget, QTableWidgetItem, QVBoxLayout, QWidget)

from engine.errors import UserError

from app.download_dialog import DownloadDialog
from app.library import ModelEntry, ModelLibrary, human_size
from app.plan_service import PlanService
from app.tasks import TaskManager

COLUMNS = ("Name", "Architecture", "Experts", "Quant types", "Size", "Fits this machine", "Last used")
FIT_COLUMN = COLUMNS.index("Fits this machine")


def when_text(t: float | None, now: float | None = None) -> str:
    if t is None:
        return "never"
    age = (now or time.time()) - t
    if age < 60:
        return "just now"
    if age < 3600:
        return f"{age // 60:.0f} min ago"
    if age < 86400:
        return f"{age // 3600:.0f} h ago"
    return time.strftime("%Y-%m-%d", time.localtime(t))


def fit_text(plan: dict) -> str:
    if plan["fits"]:
        return "yes, " + ("GPU + CPU" if plan["mode"] == "gpu" else "on the CPU")
    return "no: " + (plan["warnings"][0] if plan["warnings"] else "needs more memory than this machine has")


class ModelsPanel(QWidget):
    useRequested = Signal(str)  # a model path: restart the engine on it
    modelsChanged = Signal(list)  # list[ModelEntry], after every listing

    def __init__(self, library: ModelLibrary, tasks: TaskManager, parent: QWidget | None = None):
        super().__init__(parent)
        self.library, self.tasks = library, tasks
        self.entries: list[ModelEntry] = []
        self.fits: dict[str, str] = {}  # path -> the planner's verdict text, kept across listings
        self.plan_service: PlanService | None = None
        self.download_dialog: DownloadDialog | None = None  # made on first use
        self.current_model: str | None = None
        self._listing = False
        self._stopped = False  # after stop(): a listing still in flight must not start the planner helper

        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        self.table.setWordWrap(False)
        self.table.setTextElideMode(Qt.ElideRight)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.Interactive)
        header.setSectionResizeMode(0, QHeaderView.Stretch)
        header.setSectionResizeMode(FIT_COLUMN, QHeaderView.Stretch)
        self.table.doubleClicked.connect(lambda _i: self._use_selected())
        self.table.itemSelectionChanged.connect(self._selection_changed)

        self.use_btn = QPushButton("Use this model")
        self.use_btn.setToolTip("Restart the engine on the selected model")
        self.open_btn = QPushButton("Open file\u2026")
        self.open_btn.setToolTip("Add a GGUF file from anywhere; it is remembered")
        self.forget_btn = QPushButton("Forget")
        self.forget_btn.setToolTip("Remove an opened file from this list (the file itself stays)")
        self.download_btn = QPushButton("Download\u2026")
        self.download_btn.setToolTip("Search Hugging Face for GGUF models and download one into the models folder")
        self.folder_btn = QPushButton("Open models folder")
        self.refresh_btn = QPushButton("Refresh")
        self.use_btn.clicked.connect(self._use_selected)
        self.open_btn.clicked.connect(self._open_file)
        self.forget_btn.clicked.connect(self._forget_selected)
        self.download_btn.clicked.connect(self.open_download)
        self.folder_btn.clicked.connect(lambda: QDesktopServices.openUrl(QUrl.fromLocalFile(str(library.models_dir))))
        self.refresh_btn.clicked.connect(self.refresh)
        buttons = QHBoxLayout()
        for b in (self.use_btn, self.open_btn, self.forget_btn, self.download_btn):
            buttons.addWidget(b)
        buttons.addStretch(1)
        buttons.addWidget(self.folder_btn)
        buttons.addWidget(self.refresh_btn)
        self.note = QLabel(f"Models folder: {library.models_dir} (every .gguf in it is listed; downloads land there). "
                           "\u201cFits\u201d is the memory plan at the default options; the setup wizard prices others.")
        self.note.setWordWrap(True)
        self.error = QLabel()
        self.error.setWordWrap(True)
        self.error.setStyleSheet("color: #d04040")
        lay = QVBoxLayout(self)
        lay.addLayout(buttons)
        lay.addWidget(self.table, 1)
        lay.addWidget(self.error)
        lay.addWidget(self.note)
        self._selection_changed()

    # ---- listing -------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Lists the library again (off the GUI thread: new files' headers are read)."""
        if self._listing or self._stopped:
            return
        self._listing = True

        def failed(e: BaseException) -> None:
            self._listing = False
            self.error.setText(f"Could not list the models: {e}")

        self.tasks.run(self.library.entries, self._show, failed)

    def _show(self, entries: list[ModelEntry]) -> None:
        self._listing = False
        if self._stopped:
            return
        selected = self.selected_path()
        self.entries = entries
        self.table.setRowCount(len(entries))
        for row, e in enumerate(entries):
            info = e.info
            cells = (e.display_name, info.arch if info else "\u2014",
                     (f"{info.n_expert} ({info.n_expert_used} active)" if info.n_expert else "dense") if info else "\u2014",
                     ", ".join(info.quant_types[:3]) if info else "\u2014", human_size(e.size_bytes),
                     e.error or self.fits.get(e.path, "checking\u2026"), when_text(e.last_used))
            for col, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setToolTip(e.path if col == 0 else text)
                if col == 0:
                    item.setData(Qt.UserRole, e.path)
                    if e.path == self.current_model:
                        font = item.font()
                        font.setBold(True)
                        item.setFont(font)
                self.table.setItem(row, col, item)
            if e.path == selected:
                self.table.selectRow(row)
        self.modelsChanged.emit(entries)
        for e in entries:
            if e.info and e.path not in self.fits:
                self._ask_fit(e)

    def _ask_fit(self, e: ModelEntry) -> None:
        if not e.info.n_expert:
            self._set_fit(e.path, "dense model: runs with the llama.cpp engine")
            return
        self.planner().request("plan", lambda plan, p=e.path: self._set_fit(p, fit_text(plan)),
                                  lambda err, p=e.path: self._set_fit(p, f"unknown: {err}"), model=e.path, options={})

    def planner(self) -> PlanService:
        if self.plan_service is None:
            self.plan_service = PlanService(self)
        return self.plan_service

    def _set_fit(self, path: str, text: str) -> None:
        self.fits[path] = text
        for row in range(self.table.rowCount()):
            if self.table.item(row, 0).data(Qt.UserRole) == path:
                item = self.table.item(row, FIT_COLUMN)
                item.setText(text)
                item.setToolTip(text)

    def set_current(self, path: str | None) -> None:
        self.current_model = path
        for row in range(self.table.rowCount()):
            item = self.table.item(row, 0)
            font = item.font()
            font.setBold(item.data(Qt.UserRole) == path)
            item.setFont(font)

    def stop(self) -> None:
        self._stopped = True
        if self.download_dialog is not None:
            self.download_dialog.close()  # cancels a running download (resumable)
        if self.plan_service is not None:
            self.plan_service.stop()

    # ---- actions -------------------------------------------------------------------------------
    def selected_path(self) -> str | None:
        rows = self.table.selectionModel().selectedRows()
        return self.table.item(rows[0].row(), 0).data(Qt.UserRole) if rows else None

    def _selected_entry(self) -> ModelEntry | None:
        path = self.selected_path()
        return next((e for e in self.entries if e.path == path), None)

    def _selection_changed(self) -> None:
        e = self._selected_entry()
        self.use_btn.setEnabled(bool(e and e.info))
        self.forget_btn.setEnabled(bool(e and e.opened))

    def _use_selected(self) -> None:
        e = self._selected_entry()
        if e is None:
            return
        if e.info is None:
            self.error.setText(f"{Path(e.path).name}: {e.error}")
            return
        self.error.setText("")
        self.useRequested.emit(e.path)

    def add_file(self, path: str) -> bool:
        try:
            self.library.add(path)
        except UserError as e:
            self.error.setText(str(e))
            return False
        self.error.setText("")
        self.refresh()
        return True

    def open_download(self) -> None:
        if self.download_dialog is None:
            self.download_dialog = DownloadDialog(self.library.models_dir, self.tasks, self.planner(), self)
            self.download_dialog.downloaded.connect(lambda _path: self.refresh())
        self.download_dialog.show()
        self.download_dialog.raise_()

    def _open_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a GGUF model", "", "GGUF models (*.gguf);;All files (*)")
        if path:
            self.add_file(path)

    def _forget_selected(self) -> None:
        e = self._selected_entry()
        if e is not None and e.opened:
            self.library.forget(e.path)
            self.refresh()
