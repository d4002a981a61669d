"""The logs tab: the engine worker's output, filterable and copyable; the same lines go to
engine.log under the platformdirs log dir (rotating)."""
from __future__ import annotations


from pathlib import Path

from PySide6.QtCore import QUrl
from PySide6.QtGui import QDesktopServices, QFont, QGuiApplication
from PySide6.QtWidgets import (QComboBox, QHBoxLayout, QLabel, QLineEdit, QPlainTextEdit, QPushButton,
                               QVBoxLayout, QWidget)

from app.log_buffer import LEVELS, LogBuffer, LogLine, matches


class LogsWidget(QWidget):
    def __init__(self, buffer: LogBuffer, log_dir: Path, parent: QWidget | None = None):
        super().__init__(parent)
        self.buffer, self.log_dir = buffer, Path(log_dir)
        self.filter = QLineEdit(placeholderText="Filter (text)", clearButtonEnabled=True)
        self.level = QComboBox()
        self.level.addItems(["all levels"] + [f"{lv} and above" for lv in LEVELS[2:]])
        self.copy_btn = QPushButton("Copy shown lines")
        self.folder_btn = QPushButton("Open log folder")
        self.count_label = QLabel()
        self.view = QPlainTextEdit(readOnly=True)
        self.view.setMaximumBlockCount(buffer.lines.maxlen or 20000)
        self.view.setLineWrapMode(QPlainTextEdit.NoWrap)
        font = QFont("monospace")
        font.setStyleHint(QFont.Monospace)
        self.view.setFont(font)
        row = QHBoxLayout()
        row.addWidget(self.filter, 1)
        row.addWidget(self.level)
        row.addWidget(self.copy_btn)
        row.addWidget(self.folder_btn)
        lay = QVBoxLayout(self)
        lay.addLayout(row)
        lay.addWidget(self.view, 1)
        lay.addWidget(self.count_label)
        self.filter.textChanged.connect(self.refilter)
        self.level.currentIndexChanged.connect(self.refilter)
        self.copy_btn.clicked.connect(self.copy)
        self.folder_btn.clicked.connect(lambda: QDesktopServices.openUrl(QUrl.fromLocalFile(str(self.log_dir))))
        self.refilter()

    def _min_level(self) -> str:
        i = self.level.currentIndex()
        return "DEBUG" if i <= 0 else LEVELS[i + 1]

    def append(self, line: LogLine) -> None:
        if matches(line, self.filter.text(), self._min_level()):
            bar = self.view.verticalScrollBar()
            at_bottom = bar.value() >= bar.maximum() - 4
            self.view.appendPlainText(line.format())
            if at_bottom:
                bar.setValue(bar.maximum())
        self._count()

    def refilter(self, *_a) -> None:
        lines = self.buffer.filtered(self.filter.text(), self._min_level())
        self.view.setPlainText("\n".join(ln.format() for ln in lines))
        self.view.verticalScrollBar().setValue(self.view.verticalScrollBar().maximum())
        self._count()

    def _count(self) -> None:
        self.count_label.setText(f"{self.view.blockCount() if self.view.toPlainText() else 0} of "
                                 f"{len(self.buffer.lines)} lines shown \u00b7 full log: {self.log_dir / 'engine.log'}")

    def shown_text(self) -> str:
        return self.view.toPlainText()

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.shown_text())
