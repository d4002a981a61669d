"""Download a model from Hugging Face: search GGUF repos, pick a file (quant) with its size and
whether it fits this machine, then watch it download with speed and time left; Cancel keeps what
arrived and Resume continues from there. The hub calls and the transfer (app/downloads.py) run
on the task manager's threads; progress comes back through a queued signal, a few times a
second, so the window never waits on the network."""
from __future__ import annotations


import threading
import time

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import (QAbstractItemView, QDialog, QHBoxLayout, QHeaderView, QLabel, QLineEdit, QListWidget,
                               QListWidgetItem, QProgressBar, QPushButton, QSplitter, QTableWidget, QTableWidgetItem,
                               QVBoxLayout, QWidget)

from app.downloads import (Cancelled, HubChoice, destination, download, eta_text, fit_estimate, hub_endpoint,
                           partial_bytes, repo_choices, search_gguf_repos)
from app.library import human_size
from app.plan_service import PlanService
from app.tasks import TaskManager

FILE_COLUMNS = ("File", "Quant", "Size", "Fits this machine", "On disk")
PROGRESS_EVERY_S = 0.1


class _ProgressBridge(QObject):
    progress = Signal(object, object, float)  # done, total (Python ints: files pass 2 GiB), bytes/s


class DownloadDialog(QDialog):
    downloaded = Signal(str)  # the model file's path, in the models folder

    def __init__(self, models_dir, tasks: TaskManager, plan_service: PlanService, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Download a model from Hugging Face")
        self.resize(900, 560)
        self.models_dir, self.tasks = models_dir, tasks
        self.hardware: dict | None = None
        self.choices: list[HubChoice] = []
        self._repo: str | None = None
        self.busy = False
        self._cancel: threading.Event | None = None
        self._bridge = _ProgressBridge(self)
        self._bridge.progress.connect(self._progress)
        self._probe_error: str | None = None
        plan_service.request("probe", self._hardware_known, self._probe_failed)

        self.query = QLineEdit(placeholderText="Search GGUF models, e.g. qwen3 30b a3b", clearButtonEnabled=True)
        self.search_btn = QPushButton("Search")
        self.repos = QListWidget()
        self.repos.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)  # long names end in "…" (full in the tooltip)
        self.repos.setTextElideMode(Qt.ElideRight)
        self.files = QTableWidget(0, len(FILE_COLUMNS))
        self.files.setHorizontalHeaderLabels(FILE_COLUMNS)
        self.files.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.files.setSelectionMode(QAbstractItemView.SingleSelection)
        self.files.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.files.verticalHeader().setVisible(False)
        self.files.setTextElideMode(Qt.ElideMiddle)
        self.files.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
        self.files.horizontalHeader().setSectionResizeMode(0, QHeaderView.Stretch)
        self.progress_bar = QProgressBar()
        self.progress_bar.setRange(0, 1000)
        self.status = QLabel(f"Hub: {hub_endpoint()}")
        self.status.setWordWrap(True)
        self.error = QLabel()
        self.error.setWordWrap(True)
        self.error.setStyleSheet("color: #d04040")
        self.download_btn = QPushButton("Download")
        self.cancel_btn = QPushButton("Cancel download")
        self.close_btn = QPushButton("Close")

        top = QHBoxLayout()
        top.addWidget(self.query, 1)
        top.addWidget(self.search_btn)
        split = QSplitter()
        split.addWidget(self.repos)
        split.addWidget(self.files)
        split.setStretchFactor(1, 1)
        split.setSizes([300, 600])
        bottom = QHBoxLayout()
        bottom.addWidget(self.progress_bar, 1)
        bottom.addWidget(self.download_btn)
        bottom.addWidget(self.cancel_btn)
        bottom.addWidget(self.close_btn)
        lay = QVBoxLayout(self)
        lay.addLayout(top)
        lay.addWidget(split, 1)
        lay.addWidget(self.status)
        lay.addWidget(self.error)
        lay.addLayout(bottom)

        self.search_btn.clicked.connect(self.search)
        self.query.returnPressed.connect(self.search)
        self.repos.currentItemChanged.connect(lambda item, _old: item and self._open_repo(item.data(Qt.UserRole)))
        self.files.itemSelectionChanged.connect(self._update_buttons)
        self.download_btn.clicked.connect(self.start_download)
        self.cancel_btn.clicked.connect(self.cancel)
        self.close_btn.clicked.connect(self.close)
        self._update_buttons()

    # ---- hub ---------------------------------------------------------------------------------
    def search(self) -> None:
        query = self.query.text()
        self.error.setText("")
        self.status.setText(f"Searching {hub_endpoint()} for \u201c{query.strip()}\u201d\u2026")
        self.tasks.run(lambda: search_gguf_repos(query), self._show_repos, self._failed)

    def _show_repos(self, hits) -> None:
        self.repos.clear()
        for h in hits:
            item = QListWidgetItem(f"{h.repo_id}  ({h.downloads:,} downloads)")
            item.setData(Qt.UserRole, h.repo_id)
            item.setToolTip(f"{h.repo_id}: {h.downloads:,} downloads, {h.likes:,} likes")
            self.repos.addItem(item)
        self.status.setText(f"{len(hits)} GGUF repositories" if hits else "No GGUF repositories match; "
                            "try fewer or other words")

    def _open_repo(self, repo_id: str) -> None:
        self.files.setRowCount(0)
        self.choices = []
        self._repo = repo_id  # an answer for a repo clicked earlier is dropped
        self.status.setText(f"Reading the files of {repo_id}\u2026")
        self.tasks.run(lambda: repo_choices(repo_id), lambda c: repo_id == self._repo and self._show_files(c),
                       self._failed)

    def _show_files(self, choices: list[HubChoice]) -> None:
        self.choices = choices
        self._fill_files()
        self.status.setText(f"{len(choices)} GGUF models in {choices[0].repo_id}" if choices
                            else "This repository holds no GGUF file")
        self._update_buttons()

    def _fill_files(self) -> None:
        """The table from `choices`, the selected row kept (the fit and On disk columns change)."""
        choices = self.choices
        selected = self.files.selectionModel().selectedRows()
        self.files.setRowCount(len(choices))
        for row, c in enumerate(choices):
            parts = f" ({len(c.files)} parts)" if len(c.files) > 1 else ""
            on_disk = partial_bytes(self.models_dir, c)
            cells = (c.name + parts, c.quant, human_size(c.size), self._fit(c),
                     "complete" if on_disk == c.size else (f"{human_size(on_disk)} (resumable)" if on_disk else ""))
            for col, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setToolTip(text)
                self.files.setItem(row, col, item)
        if selected and selected[0].row() < len(choices):
            self.files.selectRow(selected[0].row())

    def _fit(self, c: HubChoice) -> str:
        if self.hardware:
            return fit_estimate(c.size, self.hardware)[1]
        return f"unknown ({self._probe_error})" if self._probe_error else "checking\u2026"

    def _probe_failed(self, error: str) -> None:
        self._probe_error = error.splitlines()[0] if error else "the hardware probe failed"
        self._fill_files()

    def _hardware_known(self, hardware: dict) -> None:
        self.hardware = hardware
        self._fill_files()

    def _failed(self, e: BaseException) -> None:
        self.status.setText("")
        self.error.setText(str(e).splitlines()[0] if str(e) else type(e).__name__)

    # ---- download ------------------------------------------------------------------------------
    def selected(self) -> HubChoice | None:
        rows = self.files.selectionModel().selectedRows()
        return self.choices[rows[0].row()] if rows else None

    def _update_buttons(self) -> None:
        c = self.selected()
        on_disk = partial_bytes(self.models_dir, c) if c else 0
        self.download_btn.setText("Resume" if c and 0 < on_disk < c.size else "Download")
        self.download_btn.setEnabled(bool(c) and not self.busy)
        self.cancel_btn.setEnabled(self.busy)
        self.search_btn.setEnabled(not self.busy)

    def start_download(self) -> None:
        c = self.selected()
        if c is None or self.busy:
            return
        self.busy = True
        self.error.setText("")
        self._cancel = cancel = threading.Event()
        last = [0.0]

        def progress(done: int, total: int, speed: float) -> None:  # on the download thread
            now = time.monotonic()
            if now - last[0] >= PROGRESS_EVERY_S or done >= total:
                last[0] = now
                self._bridge.progress.emit(done, total, speed)

        self.status.setText(f"Downloading {c.name} to {destination(self.models_dir, c.repo_id, c.name).parent}\u2026")
        self._update_buttons()
        self.tasks.run(lambda: download(c, self.models_dir, progress, cancel), self._done, self._download_failed)

    def cancel(self) -> None:
        if self._cancel is not None:
            self._cancel.set()

    def _progress(self, done: int, total: int, speed: float) -> None:
        self.progress_bar.setValue(int(1000 * done / total) if total else 0)
        self.progress_bar.setFormat(f"{100 * done / total:.0f}%" if total else "")
        self.status.setText(f"{human_size(done)} of {human_size(total)}, {human_size(int(speed))}/s, "
                            f"{eta_text(total - done, speed)}")

    def _done(self, path) -> None:
        self.busy = False
        self.status.setText(f"Downloaded and verified (sha256): {path}. It is in the library now.")
        self._refresh_rows()
        self.downloaded.emit(str(path))

    def _download_failed(self, e: BaseException) -> None:
        self.busy = False
        if isinstance(e, Cancelled):
            self.status.setText("Cancelled; what arrived is kept: Resume continues from there.")
        else:
            self._failed(e)
        self._refresh_rows()

    def _refresh_rows(self) -> None:
        self._fill_files()
        self._update_buttons()

    def closeEvent(self, event) -> None:
        self.cancel()  # a download left running would hold the file open; what arrived stays resumable
        super().closeEvent(event)
