"""The chat tab: conversation list with search, messages rendered as Markdown (regenerated
replies keep their earlier versions, browsable with ‹ ›), the input box with the context
meter, export (Markdown, JSON), and the per-conversation settings (system prompt, sampling,
stop strings)."""
from __future__ import annotations

import re
from pathlib import Path

from PySide6.QtCore import QSize, Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication, QKeyEvent, QTextDocument
from PySide6.QtWidgets import (QAbstractItemView, QComboBox, QDoubleSpinBox, QFileDialog, QFormLayout, QFrame,
                               QHBoxLayout, QInputDialog, QLabel, QLineEdit, QListWidget, QListWidgetItem, QMessageBox,
                               QPlainTextEdit, QProgressBar, QPushButton, QScrollArea, QSpinBox, QSplitter,
                               QSizePolicy, QStyledItemDelegate, QToolButton, QVBoxLayout, QWidget)

from app.chat.controller import ChatController
from app.chat.markdown import code_blocks, display_markdown
from app.chat.session import (DEFAULT_SETTINGS, context_used, format_prompt_progress, format_stats, format_stops,
                              parse_stops)
from app.store import Message
from engine.errors import UserError

STATUS_NOTE = {
    "streaming": "writing\u2026",
    "stopped": "stopped",
    "interrupted": "interrupted: the engine or the app stopped during this reply",
    "error": "error",
}


_DOC = None


def markdown_html(text: str) -> str:
    """Markdown to Qt rich text (Qt's own CommonMark/GitHub reader), with code blocks shaded."""
    global _DOC
    if _DOC is None:
        _DOC = QTextDocument()
    _DOC.setMarkdown(text)
    html = _DOC.toHtml()
    html = re.sub(r"<body style=\"[^\"]*\">", "<body>", html)  # the label's own font, not the document's
    return html.replace("<pre style=\"", "<pre style=\" background-color:rgba(128,128,128,40);")


class MessageWidget(QFrame):
    copyRequested = Signal(str)
    editRequested = Signal(int)
    regenerateRequested = Signal()
    versionRequested = Signal(int, int)  # message id, version number

    def __init__(self, msg: Message, parent: QWidget | None = None):
        super().__init__(parent)
        self.msg = msg
        self.setObjectName("message")
        self.setFrameShape(QFrame.StyledPanel)
        self.setProperty("role", msg.role)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(10, 6, 10, 6)
        head = QHBoxLayout()
        self.role_label = QLabel("<b>You</b>" if msg.role == "user" else "<b>Assistant</b>")
        self.status_label = QLabel()
        self.status_label.setObjectName("messageStatus")
        head.addWidget(self.role_label)
        head.addWidget(self.status_label, 1)
        self.copy_btn = QToolButton(text="Copy", toolTip="Copy this message as Markdown")
        self.code_btn = QToolButton(text="Copy code", toolTip="Copy the last code block of this message")
        self.edit_btn = QToolButton(text="Edit", toolTip="Edit this message and send it again "
                                    "(the replies after it are replaced)")
        self.regen_btn = QToolButton(text="Regenerate", toolTip="Write a new version of this reply (the earlier ones "
                                     "stay, browsable with \u2039 \u203a)")
        self.prev_btn = QToolButton(text="\u2039", toolTip="The previous version of this reply")
        self.version_label = QLabel()
        self.next_btn = QToolButton(text="\u203a", toolTip="The next version of this reply")
        for b in (self.prev_btn, self.version_label, self.next_btn, self.copy_btn, self.code_btn, self.edit_btn,
                  self.regen_btn):
            if isinstance(b, QToolButton):
                b.setAutoRaise(True)
            head.addWidget(b)
        self.prev_btn.clicked.connect(lambda: self.versionRequested.emit(self.msg.id, self.msg.version - 1))
        self.next_btn.clicked.connect(lambda: self.versionRequested.emit(self.msg.id, self.msg.version + 1))
        self.copy_btn.clicked.connect(lambda: self.copyRequested.emit(self.msg.content))
        self.code_btn.clicked.connect(self._copy_code)
        self.edit_btn.clicked.connect(lambda: self.editRequested.emit(self.msg.id))
        self.regen_btn.clicked.connect(self.regenerateRequested.emit)
        lay.addLayout(head)
        self.body = QLabel()
        self.body.setTextFormat(Qt.RichText)
        self.body.setWordWrap(True)
        self.body.setTextInteractionFlags(Qt.TextSelectableByMouse | Qt.LinksAccessibleByMouse)
        self.body.setOpenExternalLinks(True)
        lay.addWidget(self.body)
        self.stats_label = QLabel()
        self.stats_label.setObjectName("messageStats")
        lay.addWidget(self.stats_label)
        self.edit_btn.setVisible(msg.role == "user")
        self.regen_btn.setVisible(False)
        self._versions_enabled = True  # off while a reply streams
        self.update_from(msg)

    def _copy_code(self) -> None:
        blocks = code_blocks(self.msg.content)
        if blocks:
            self.copyRequested.emit(blocks[-1])

    def update_from(self, msg: Message) -> None:
        self.msg = msg
        streaming = msg.status == "streaming"
        self.body.setText(markdown_html(display_markdown(msg.content, streaming) if (msg.content or streaming)
                                        else "*(no text)*"))
        note = STATUS_NOTE.get(msg.status, "")
        self.status_label.setText(f"<i>{note}</i>" if note else "")
        self.stats_label.setText(format_stats(msg.stats) if msg.role == "assistant" else "")
        self.stats_label.setVisible(bool(self.stats_label.text()))
        self.code_btn.setVisible(bool(code_blocks(msg.content)))
        self.copy_btn.setEnabled(bool(msg.content))
        for w in (self.prev_btn, self.version_label, self.next_btn):
            w.setVisible(msg.versions > 1)
        self.version_label.setText(f"{msg.version}/{msg.versions}")
        self._enable_versions()

    def show_prompt_progress(self, processed: int, total: int) -> None:
        """While the reply waits for its first token: how much of the prompt the engine has read."""
        if self.msg.status == "streaming" and not self.msg.content:
            self.status_label.setText(f"<i>{format_prompt_progress(processed, total)}</i>")

    def _enable_versions(self) -> None:
        self.prev_btn.setEnabled(self._versions_enabled and self.msg.version > 1)
        self.next_btn.setEnabled(self._versions_enabled and self.msg.version < self.msg.versions)

    def set_actions_enabled(self, enabled: bool, last_reply: bool) -> None:
        self.edit_btn.setEnabled(enabled)
        self.regen_btn.setVisible(self.msg.role == "assistant" and last_reply)
        self.regen_btn.setEnabled(enabled)
        self._versions_enabled = enabled
        self._enable_versions()


class _FitWidthDelegate(QStyledItemDelegate):
    """List rows as wide as the list, never wider: a long title is drawn elided instead of
    widening its row (which is what makes a list scroll sideways)."""

    def sizeHint(self, option, index) -> QSize:
        return QSize(0, super().sizeHint(option, index).height())


class _InputBox(QPlainTextEdit):
    submitted = Signal()

    def keyPressEvent(self, e: QKeyEvent) -> None:
        if e.key() in (Qt.Key_Return, Qt.Key_Enter) and not (e.modifiers() & Qt.ShiftModifier):
            self.submitted.emit()
            return
        super().keyPressEvent(e)


class ChatWidget(QWidget):
    modelChosen = Signal(str)  # a model path from the header's picker: restart the engine on it

    def __init__(self, controller: ChatController, parent: QWidget | None = None):
        super().__init__(parent)
        self.c = controller
        self._widgets: dict[int, MessageWidget] = {}
        self._editing: int | None = None
        self._engine_ready = False
        self._loading_settings = False
        self._picker_model: str | None = None  # the model the picker shows as the engine's

        # conversations
        left = QWidget()
        ll = QVBoxLayout(left)
        ll.setContentsMargins(0, 0, 0, 0)
        self.search = QLineEdit(placeholderText="Search chats\u2026", clearButtonEnabled=True)
        self.conv_list = QListWidget()
        self.conv_list.setSelectionMode(QAbstractItemView.SingleSelection)
        # Long titles end in "…" (the whole title is the tooltip); the list never scrolls sideways.
        self.conv_list.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.conv_list.setItemDelegate(_FitWidthDelegate(self.conv_list))
        self.conv_list.setTextElideMode(Qt.ElideRight)
        self.conv_list.setWordWrap(False)
        self.conv_list.setUniformItemSizes(True)
        row = QHBoxLayout()
        self.new_btn = QToolButton(text="New")
        self.rename_btn = QToolButton(text="Rename")
        self.delete_btn = QToolButton(text="Delete")
        self.export_btn = QToolButton(text="Export\u2026", toolTip="Save this chat as Markdown (.md) or JSON (.json)")
        for b in (self.new_btn, self.rename_btn, self.delete_btn, self.export_btn):
            row.addWidget(b)
        row.addStretch(1)
        ll.addWidget(self.search)
        ll.addWidget(self.conv_list, 1)
        ll.addLayout(row)

        # messages + input
        center = QWidget()
        cl = QVBoxLayout(center)
        cl.setContentsMargins(0, 0, 0, 0)
        self.banner = QLabel()
        self.banner.setObjectName("chatBanner")
        self.banner.setWordWrap(True)
        self.banner.setVisible(False)
        self.scroll = QScrollArea()
        self.scroll.setWidgetResizable(True)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.msg_host = QWidget()
        self.msg_layout = QVBoxLayout(self.msg_host)
        self.empty_label = QLabel("Send a message to start. Replies stream in as the model writes them; "
                                  "everything is saved as it arrives.")
        self.empty_label.setAlignment(Qt.AlignCenter)
        self.empty_label.setWordWrap(True)
        self.msg_layout.addWidget(self.empty_label)
        self.msg_layout.addStretch(1)
        self.scroll.setWidget(self.msg_host)
        self.edit_banner = QLabel()
        self.edit_banner.setVisible(False)
        self.cancel_edit_btn = QToolButton(text="Cancel edit")
        self.cancel_edit_btn.setVisible(False)
        eb = QHBoxLayout()
        eb.addWidget(self.edit_banner, 1)
        eb.addWidget(self.cancel_edit_btn)
        self.input = _InputBox()
        self.input.setPlaceholderText("Message (Enter sends, Shift+Enter for a new line)")
        self.input.setMaximumHeight(110)
        buttons = QHBoxLayout()
        self.send_btn = QPushButton("Send")
        self.send_btn.setDefault(True)
        self.stop_btn = QPushButton("Stop")
        self.regen_btn = QPushButton("Regenerate")
        self.settings_btn = QToolButton(text="Chat settings", checkable=True)
        buttons.addWidget(self.settings_btn)
        buttons.addStretch(1)
        buttons.addWidget(self.regen_btn)
        buttons.addWidget(self.stop_btn)
        buttons.addWidget(self.send_btn)
        # the context meter, above the messages: how full this chat's context is
        self.context_label = QLabel(toolTip="Tokens the last turn of this chat occupied (prompt and reply) out of "
                                    "the engine's context length; the next message must fit in what is left.")
        self.context_bar = QProgressBar(textVisible=False)
        self.context_bar.setObjectName("contextMeter")
        self.context_bar.setFixedSize(120, 8)
        self._context_size: int | None = None
        # the header: which model answers (a picker over the model library) and the context meter
        self.model_picker = QComboBox(toolTip="The model the engine runs; choosing another restarts the engine on it "
                                      "(the Models tab lists, adds and downloads models)")
        # as wide as the header has room for, 140-420 px: its hints follow the longest name and the placeholder
        self.model_picker.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Fixed)
        self.model_picker.setMinimumWidth(140)
        self.model_picker.setMaximumWidth(420)
        self.model_picker.setPlaceholderText("no model yet: see the Models tab")
        self.model_picker.activated.connect(self._model_picked)
        meter = QHBoxLayout()
        meter.addWidget(QLabel("Model"))
        meter.addWidget(self.model_picker, 1)
        meter.addStretch(1)
        meter.addWidget(self.context_label)
        meter.addWidget(self.context_bar)
        cl.addLayout(meter)
        cl.addWidget(self.banner)
        cl.addWidget(self.scroll, 1)
        cl.addLayout(eb)
        cl.addWidget(self.input)
        cl.addLayout(buttons)

        # per-conversation settings
        self.settings_panel = QWidget()
        form = QFormLayout(self.settings_panel)
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setPlaceholderText("System prompt (optional)")
        self.temperature = QDoubleSpinBox(minimum=0.0, maximum=2.0, singleStep=0.05, decimals=2)
        self.top_p = QDoubleSpinBox(minimum=0.0, maximum=1.0, singleStep=0.05, decimals=2)
        self.top_k = QSpinBox(minimum=0, maximum=1000, singleStep=5, specialValueText="off")
        self.min_p = QDoubleSpinBox(minimum=0.0, maximum=1.0, singleStep=0.01, decimals=2, specialValueText="off")
        self.repeat_penalty = QDoubleSpinBox(minimum=0.5, maximum=2.0, singleStep=0.05, decimals=2,
                                             toolTip="1.00 = off; above 1 makes repeating recent tokens less likely")
        self.stops = QPlainTextEdit()
        self.stops.setPlaceholderText("One per line; \\n for a newline")
        self.stops.setMaximumHeight(70)
        self.settings_error = QLabel()
        self.settings_error.setObjectName("settingsError")
        self.settings_error.setWordWrap(True)
        self.settings_error.setVisible(False)
        self.max_tokens = QSpinBox(minimum=1, maximum=131072, singleStep=64)
        self.seed = QSpinBox(minimum=-1, maximum=2**31 - 1, specialValueText="random")
        form.addRow("System prompt", self.system_prompt)
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-p", self.top_p)
        form.addRow("Top-k", self.top_k)
        form.addRow("Min-p", self.min_p)
        form.addRow("Repeat penalty", self.repeat_penalty)
        form.addRow("Stop strings", self.stops)
        form.addRow("Max tokens", self.max_tokens)
        form.addRow("Seed", self.seed)
        form.addRow(self.settings_error)
        self.settings_panel.setVisible(False)
        self.settings_panel.setMinimumWidth(240)

        split = QSplitter()
        split.addWidget(left)
        split.addWidget(center)
        split.addWidget(self.settings_panel)
        split.setStretchFactor(1, 1)
        split.setSizes([220, 700, 260])
        outer = QVBoxLayout(self)
        outer.setContentsMargins(6, 6, 6, 6)
        outer.addWidget(split)
        self.msg_host.setObjectName("messages")
        self.msg_host.setStyleSheet(  # palette roles: follows the system's light or dark theme
            "QFrame#message { border: 1px solid palette(mid); border-radius: 6px; background: palette(base); }"
            "QFrame#message[role='user'] { background: palette(alternate-base); }"
            "QLabel#messageStats, QLabel#messageStatus { color: palette(placeholder-text); }")

        # wiring
        self.new_btn.clicked.connect(self.c.new_conversation)
        self.rename_btn.clicked.connect(self._rename)
        self.delete_btn.clicked.connect(self._delete)
        self.search.textChanged.connect(lambda _t: self.refresh_conversations())
        self.conv_list.currentItemChanged.connect(self._conv_selected)
        self.send_btn.clicked.connect(self.submit)
        self.input.submitted.connect(self.submit)
        self.stop_btn.clicked.connect(self.c.stop)
        self.regen_btn.clicked.connect(self.c.regenerate)
        self.cancel_edit_btn.clicked.connect(self._cancel_edit)
        self.settings_btn.toggled.connect(self.settings_panel.setVisible)
        self.export_btn.clicked.connect(self._export)
        self.system_prompt.textChanged.connect(self._settings_edited)
        self.stops.textChanged.connect(self._settings_edited)
        for w in (self.temperature, self.top_p, self.top_k, self.min_p, self.repeat_penalty, self.max_tokens,
                  self.seed):
            w.valueChanged.connect(self._settings_edited)
        self.c.conversationsChanged.connect(self.refresh_conversations)
        self.c.conversationOpened.connect(self._rebuild)
        self.c.messageAdded.connect(self._add_message)
        self.c.messageChanged.connect(self._message_changed)
        self.c.promptProgress.connect(self._prompt_progress)
        self.c.busyChanged.connect(lambda _b: self._update_buttons())
        self.c.error.connect(self.show_banner)
        self.refresh_conversations()
        self._rebuild(self.c.current.id if self.c.current else -1)

    # ---- engine state -----------------------------------------------------------------------
    def set_engine_ready(self, ready: bool, message: str = "") -> None:
        self._engine_ready = ready
        if ready:
            self.banner.setVisible(False)
        elif message:
            self.show_banner(message)
        self._update_buttons()

    def show_banner(self, text: str) -> None:
        self.banner.setText(text)
        self.banner.setVisible(bool(text))

    # ---- conversations -----------------------------------------------------------------------
    def refresh_conversations(self) -> None:
        current = self.c.current.id if self.c.current else None
        self.conv_list.blockSignals(True)
        self.conv_list.clear()
        for conv in self.c.conversations(self.search.text()):
            item = QListWidgetItem(conv.title)
            item.setData(Qt.UserRole, conv.id)
            item.setToolTip(conv.title)
            self.conv_list.addItem(item)
            if conv.id == current:
                self.conv_list.setCurrentItem(item)
        self.conv_list.blockSignals(False)
        self._update_buttons()

    def _conv_selected(self, item: QListWidgetItem | None, _prev=None) -> None:
        if item is not None:
            conv_id = item.data(Qt.UserRole)
            if not self.c.current or self.c.current.id != conv_id:
                self.c.open(conv_id)

    def _selected_id(self) -> int | None:
        item = self.conv_list.currentItem()
        return item.data(Qt.UserRole) if item else (self.c.current.id if self.c.current else None)

    def _rename(self) -> None:
        conv_id = self._selected_id()
        if conv_id is None:
            return
        conv = self.c.store.conversation(conv_id)
        title, ok = QInputDialog.getText(self, "Rename chat", "Title:", text=conv.title if conv else "")
        if ok and title.strip():
            self.c.rename(conv_id, title)

    def _delete(self) -> None:
        conv_id = self._selected_id()
        if conv_id is None:
            return
        conv = self.c.store.conversation(conv_id)
        answer = QMessageBox.question(self, "Delete chat",
                                      f"Delete \u201c{conv.title if conv else conv_id}\u201d and all its messages? "
                                      "They are erased from disk; this cannot be undone.")
        if answer == QMessageBox.Yes:
            self.c.delete(conv_id)

    # ---- messages -----------------------------------------------------------------------------
    def _clear_messages(self) -> None:
        for w in self._widgets.values():
            w.setParent(None)
            w.deleteLater()
        self._widgets.clear()

    def _rebuild(self, conv_id: int) -> None:
        self._clear_messages()
        self._cancel_edit()
        for msg in self.c.messages():
            self._add_message(msg, scroll=False)
        self._load_settings()
        self.refresh_conversations()
        self._update_buttons()
        self._update_context()
        QTimer.singleShot(0, self._scroll_to_bottom)

    def _add_message(self, msg: Message, scroll: bool = True) -> None:
        if not self.c.current or msg.conversation_id != self.c.current.id or msg.id in self._widgets:
            return
        w = MessageWidget(msg)
        w.copyRequested.connect(self._copy)
        w.editRequested.connect(self._start_edit)
        w.regenerateRequested.connect(self.c.regenerate)
        w.versionRequested.connect(self.c.show_version)
        self.msg_layout.insertWidget(self.msg_layout.count() - 1, w)
        self._widgets[msg.id] = w
        self._update_buttons()
        if scroll:
            QTimer.singleShot(0, self._scroll_to_bottom)

    def _message_changed(self, msg: Message) -> None:
        w = self._widgets.get(msg.id)
        if w is None:
            return
        bar = self.scroll.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 30
        w.update_from(msg)
        self._update_buttons()
        if msg.status != "streaming":
            self._update_context()
        if at_bottom:
            QTimer.singleShot(0, self._scroll_to_bottom)

    def _prompt_progress(self, msg_id: int, processed: int, total: int) -> None:
        w = self._widgets.get(msg_id)
        if w is not None:
            w.show_prompt_progress(processed, total)

    def _scroll_to_bottom(self) -> None:
        bar = self.scroll.verticalScrollBar()
        bar.setValue(bar.maximum())

    # ---- context meter, export ------------------------------------------------------------------
    def set_models(self, models: list[tuple[str, str]], current: str | None) -> None:
        """The picker's choices, (path, label) each, with the engine's model selected."""
        self.model_picker.blockSignals(True)
        self.model_picker.clear()
        for path, label in models:
            self.model_picker.addItem(label, path)
            self.model_picker.setItemData(self.model_picker.count() - 1, path, Qt.ToolTipRole)
        if current and self.model_picker.findData(current) < 0:
            self.model_picker.addItem(Path(current).name, current)  # a model the library cannot read
        self.model_picker.setCurrentIndex(self.model_picker.findData(current) if current else -1)
        self.model_picker.blockSignals(False)
        self._picker_model = current

    def _model_picked(self, index: int) -> None:
        path = self.model_picker.itemData(index)
        if path and path != self._picker_model:
            self._picker_model = path
            self.modelChosen.emit(path)

    def set_context_size(self, n_ctx: int | None) -> None:
        """The context length the engine runs with (None while no engine is ready)."""
        self._context_size = n_ctx
        self._update_context()

    def _update_context(self) -> None:
        used = context_used([w.msg for w in self.message_widgets()])
        size = self._context_size
        bar = self.context_bar
        if size:
            bar.setRange(0, size)
            bar.setValue(min(used or 0, size))
            self.context_label.setText(f"Context {used or 0:,} / {size:,} tokens")
        else:
            bar.setRange(0, 1)
            bar.setValue(0)
            self.context_label.setText(f"Context {used:,} tokens" if used is not None else "Context: no engine")
        bar.setVisible(bool(size))

    def _export(self) -> None:
        conv_id = self._selected_id()
        conv = self.c.store.conversation(conv_id) if conv_id is not None else None
        if conv is None:
            return
        name = "".join(ch if ch.isalnum() or ch in " -_" else "_" for ch in conv.title).strip() or "chat"
        path, _ = QFileDialog.getSaveFileName(self, "Export chat", str(Path.home() / f"{name}.md"),
                                              "Markdown (*.md);;JSON with every reply version (*.json)")
        if not path:
            return
        try:
            self.c.export(conv_id, Path(path))
        except UserError as e:
            self.show_banner(str(e))

    def _copy(self, text: str) -> None:
        QGuiApplication.clipboard().setText(text)

    def message_widgets(self) -> list[MessageWidget]:
        return [self._widgets[k] for k in sorted(self._widgets)]

    # ---- sending, editing ------------------------------------------------------------------------
    def submit(self) -> None:
        text = self.input.toPlainText()
        if not text.strip() or self.c.busy or not self._engine_ready:
            return
        ok = self.c.edit_and_resend(self._editing, text) if self._editing is not None else self.c.send(text)
        if ok:
            self.input.clear()
            self._cancel_edit()

    def _start_edit(self, msg_id: int) -> None:
        msg = self.c.store.message(msg_id)
        if msg is None:
            return
        self._editing = msg_id
        self.input.setPlainText(msg.content)
        self.input.setFocus()
        self.edit_banner.setText("<b>Editing a message.</b> Send replaces it and every reply after it.")
        self.edit_banner.setVisible(True)
        self.cancel_edit_btn.setVisible(True)
        self.send_btn.setText("Send edit")

    def _cancel_edit(self) -> None:
        if self._editing is not None:
            self.input.clear()
        self._editing = None
        self.edit_banner.setVisible(False)
        self.cancel_edit_btn.setVisible(False)
        self.send_btn.setText("Send")

    def _update_buttons(self) -> None:
        busy = self.c.busy
        has_conv = self.c.current is not None
        self.send_btn.setEnabled(not busy and self._engine_ready)
        self.stop_btn.setEnabled(busy)
        msgs = self.message_widgets()
        has_user = any(w.msg.role == "user" for w in msgs)
        self.regen_btn.setEnabled(not busy and self._engine_ready and has_user)
        self.rename_btn.setEnabled(has_conv)
        self.delete_btn.setEnabled(has_conv)
        self.export_btn.setEnabled(has_conv)
        last_assistant = next((w for w in reversed(msgs) if w.msg.role == "assistant"), None)
        for w in msgs:
            w.set_actions_enabled(not busy and self._engine_ready, w is last_assistant)
        self.empty_label.setVisible(not msgs)

    # ---- settings -----------------------------------------------------------------------------
    def _load_settings(self) -> None:
        self._loading_settings = True
        conv = self.c.current
        s = {**DEFAULT_SETTINGS, **(conv.settings if conv else self.c.defaults)}
        self.system_prompt.setPlainText(conv.system_prompt if conv else self.c.default_system_prompt)
        self.temperature.setValue(float(s["temperature"]))
        self.top_p.setValue(float(s["top_p"]))
        self.top_k.setValue(int(s["top_k"]))
        self.min_p.setValue(float(s["min_p"]))
        self.repeat_penalty.setValue(float(s["repeat_penalty"]))
        self.stops.setPlainText(format_stops(s["stop"]))
        self.settings_error.setVisible(False)
        self.max_tokens.setValue(int(s["max_tokens"]))
        self.seed.setValue(int(s["seed"]))
        self._loading_settings = False

    def _settings_edited(self, *_a) -> None:
        if self._loading_settings:
            return
        try:
            stops = parse_stops(self.stops.toPlainText())
        except ValueError as e:
            self.settings_error.setText(f"Stop strings: {e}; these settings are not saved until fixed.")
            self.settings_error.setVisible(True)
            return
        self.settings_error.setVisible(False)
        values = {"temperature": self.temperature.value(), "top_p": self.top_p.value(), "top_k": self.top_k.value(),
                  "min_p": self.min_p.value(), "repeat_penalty": self.repeat_penalty.value(),
                  "max_tokens": self.max_tokens.value(), "seed": self.seed.value(), "stop": stops}
        if self.c.current is None:  # no chat yet: these become the first chat's settings
            self.c.defaults.update(values)
            self.c.default_system_prompt = self.system_prompt.toPlainText()
            return
        self.c.set_system_prompt(self.system_prompt.toPlainText())
        self.c.set_settings(values)
