"""The chat's behaviour: conversations, sending, streaming with checkpoints, stop, regenerate,
edit-and-resend. Qt only for signals and timers; storage is app/store.py, measuring is
app/chat/session.py, and the HTTP stream runs on a task-manager thread."""
from __future__ import annotations


import json
import logging
import threading
from pathlib import Path
from typing import Any, Callable

from PySide6.QtCore import QObject, QTimer, Signal

from app.api_client import ApiClient, ApiError, Cancelled, abort_connection
from app.chat.session import DEFAULT_SETTINGS, ReplyMeter, build_payload, chat_json, chat_markdown, title_from
from app.logs import APP_LOG
from app.store import ChatStore, Conversation, Message
from app.tasks import TaskManager
from engine.errors import UserError

log = logging.getLogger(APP_LOG)
NOT_RUNNING = "The engine is not running: start it from the Engine menu."


class ReplyStream(QObject):
    """One streaming reply on a worker thread; chunks come back to the GUI thread as signals."""

    chunk = Signal(object)  # a parsed chat.completion.chunk
    ended = Signal(str, str)  # outcome ("done", "stopped", "failed"), error text

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self._stop = threading.Event()
        self._conn = None
        self._stream = None
        self._lock = threading.Lock()

    def start(self, tasks: TaskManager, client: ApiClient, payload: dict[str, Any]) -> None:
        tasks.run(lambda: self._run(client, payload))

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            if self._stream is not None:
                self._stream.close()
            elif self._conn is not None:
                abort_connection(self._conn)

    def _on_connect(self, conn) -> None:
        with self._lock:
            self._conn = conn
        if self._stop.is_set():
            abort_connection(conn)

    def _run(self, client: ApiClient, payload: dict[str, Any]) -> None:
        outcome, error = "done", ""
        try:
            if self._stop.is_set():
                raise Cancelled()
            stream = client.chat_stream(payload, on_connect=self._on_connect)
            with self._lock:
                self._stream = stream
            if self._stop.is_set():
                stream.close()
            finished = False
            for event in stream:
                if event.data.strip() == "[DONE]":
                    finished = True
                    break
                obj = json.loads(event.data)
                if isinstance(obj, dict) and obj.get("error"):
                    err = obj["error"]
                    raise ApiError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
                self.chunk.emit(obj)
            if not finished:  # the connection ended without [DONE]: the engine went away mid-reply
                if self._stop.is_set():
                    raise Cancelled()
                raise ConnectionError("stream ended early")
        except Cancelled:
            outcome = "stopped"
        except Exception as e:  # connection refused/reset (engine gone), HTTP errors, bad JSON
            if self._stop.is_set():
                outcome = "stopped"
            else:
                outcome, error = "failed", _describe(e)
        try:
            self.ended.emit(outcome, error)
        except RuntimeError:
            pass  # the app is closing


def _describe(e: Exception) -> str:
    if isinstance(e, ApiError):
        return str(e)
    if isinstance(e, (ConnectionError, OSError)) or type(e).__name__ in ("RemoteDisconnected", "IncompleteRead"):
        return "the engine stopped while replying"
    return f"{type(e).__name__}: {e}"


class ChatController(QObject):
    conversationsChanged = Signal()
    conversationOpened = Signal(int)  # the view rebuilds from messages()
    messageAdded = Signal(object)  # Message
    messageChanged = Signal(object)  # Message (content, status or stats changed)
    busyChanged = Signal(bool)
    promptProgress = Signal(int, int, int)  # reply message id, prompt tokens processed, total
    error = Signal(str)
    FLUSH_MS = 100  # checkpoint + repaint interval of a growing reply

    def __init__(self, store: ChatStore, tasks: TaskManager, client_factory: Callable[[], ApiClient | None],
                 parent: QObject | None = None):
        super().__init__(parent)
        self.store, self.tasks, self.client_factory = store, tasks, client_factory
        self.current: Conversation | None = None
        self._stream: ReplyStream | None = None
        self._meter: ReplyMeter | None = None
        self._reply: Message | None = None  # the assistant message being streamed
        self.defaults: dict[str, Any] = dict(DEFAULT_SETTINGS)
        self.default_system_prompt = ""
        self._flush_timer = QTimer(self)
        self._flush_timer.setSingleShot(True)
        self._flush_timer.setInterval(self.FLUSH_MS)
        self._flush_timer.timeout.connect(self._flush)

    # ---- conversations -------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self._stream is not None

    @property
    def streaming_message_id(self) -> int | None:
        return self._reply.id if self._reply else None

    def conversations(self, search: str = "") -> list[Conversation]:
        return self.store.conversations(search)

    def messages(self) -> list[Message]:
        if self.current is None:
            return []
        return self.store.messages(self.current.id)

    def new_conversation(self) -> Conversation:
        settings = dict(self.current.settings) if self.current else dict(self.defaults)
        system = self.current.system_prompt if self.current else self.default_system_prompt
        conv = self.store.create_conversation("New chat", system, settings)
        self.conversationsChanged.emit()
        self.open(conv.id)
        return conv

    def open(self, conv_id: int) -> None:
        conv = self.store.conversation(conv_id)
        if conv is None:
            return
        self.current = conv
        self.conversationOpened.emit(conv_id)

    def rename(self, conv_id: int, title: str) -> None:
        self.store.rename(conv_id, title)
        if self.current and self.current.id == conv_id:
            self.current = self.store.conversation(conv_id)
        self.conversationsChanged.emit()

    def delete(self, conv_id: int) -> None:
        if self._reply is not None and self._reply.conversation_id == conv_id:
            self.stop()
            self._detach()
        self.store.delete_conversation(conv_id)
        if self.current and self.current.id == conv_id:
            self.current = None
            remaining = self.store.conversations()
            if remaining:
                self.open(remaining[0].id)
            else:
                self.conversationOpened.emit(-1)
        self.conversationsChanged.emit()

    def set_system_prompt(self, text: str) -> None:
        if self.current:
            self.store.update_conversation(self.current.id, system_prompt=text)
            self.current.system_prompt = text

    def set_settings(self, settings: dict[str, Any]) -> None:
        if self.current:
            merged = {**self.current.settings, **settings}
            self.store.update_conversation(self.current.id, settings=merged)
            self.current.settings = merged

    def export(self, conv_id: int, path: Path) -> None:
        """Writes a conversation to `path` as Markdown (.md) or JSON (.json, with every reply version)."""
        conv = self.store.conversation(conv_id)
        if conv is None:
            raise UserError(f"there is no chat {conv_id} to export")
        history = self.store.messages(conv_id)
        suffix = path.suffix.lower()
        if suffix in (".md", ".markdown"):
            text = chat_markdown(conv, history)
        elif suffix == ".json":
            text = chat_json(conv, history, {m.id: self.store.other_versions(m.id) for m in history if m.versions > 1})
        else:
            raise UserError(f"cannot export to {path.name}: choose a file name ending in .md (Markdown) or .json")
        try:
            path.write_text(text, encoding="utf-8")
        except OSError as e:
            raise UserError(f"cannot write {path}: {e.strerror}") from None

    # ---- turns ----------------------------------------------------------------------------
    def send(self, text: str) -> bool:
        text = text.strip()
        if not text or self.busy:
            return False
        if self.current is None:
            self.new_conversation()
        conv = self.current
        first = not self.store.messages(conv.id)
        self.messageAdded.emit(self.store.add_message(conv.id, "user", text))
        if first and conv.title == "New chat":
            self.rename(conv.id, title_from(text))
        else:
            self.conversationsChanged.emit()
        return self._reply_to(conv)

    def regenerate(self) -> bool:
        """A new version of the last reply (to the same history); the earlier ones stay, see show_version."""
        if self.busy or self.current is None:
            return False
        msgs = self.store.messages(self.current.id)
        last_user = max((i for i, m in enumerate(msgs) if m.role == "user"), default=None)
        if last_user is None:
            return False
        if self.client_factory() is None:
            self.error.emit(NOT_RUNNING)
            return False
        later = msgs[last_user + 1:]
        reply = self.store.new_version(later[0].id) if later and later[0].role == "assistant" else None
        if reply is not None and len(later) > 1:
            self.store.delete_messages_from(self.current.id, later[1].id)
        self.conversationOpened.emit(self.current.id)
        return self._reply_to(self.current, reply)

    def show_version(self, msg_id: int, version: int) -> None:
        """Shows another version of a regenerated reply; the next turn continues from it."""
        if self.busy:
            return
        msg = self.store.show_version(msg_id, version)
        self.messageChanged.emit(msg)

    def edit_and_resend(self, msg_id: int, text: str) -> bool:
        """Replaces a user message's text, drops everything after it, and asks again."""
        text = text.strip()
        if self.busy or self.current is None or not text:
            return False
        msg = self.store.message(msg_id)
        if msg is None or msg.role != "user" or msg.conversation_id != self.current.id:
            return False
        later = [m for m in self.store.messages(self.current.id) if m.id > msg_id]
        if later:
            self.store.delete_messages_from(self.current.id, later[0].id)
        self.store.update_message(msg_id, content=text)
        self.conversationOpened.emit(self.current.id)
        return self._reply_to(self.current)

    def stop(self) -> None:
        if self._stream is not None:
            self._stream.stop()

    def _reply_to(self, conv: Conversation, reply: Message | None = None) -> bool:
        """Streams a reply into `reply` (a new version of it) or into a new message after the history."""
        client = self.client_factory()
        if client is None:
            self.error.emit(NOT_RUNNING)
            return False
        history = [m for m in self.store.messages(conv.id) if reply is None or m.id < reply.id]
        payload = build_payload(conv.system_prompt, history, conv.settings)
        self._reply = reply or self.store.add_message(conv.id, "assistant", "", status="streaming")
        self._meter = ReplyMeter()
        self._stream = ReplyStream(self)
        self._stream.chunk.connect(self._on_chunk)
        self._stream.ended.connect(self._on_ended)
        self.messageAdded.emit(self._reply)
        self.busyChanged.emit(True)
        self._stream.start(self.tasks, client, payload)
        return True

    def on_stats(self, snap: dict) -> None:
        """A telemetry snapshot (the stats stream): while the streaming reply has no text yet and
        the engine is reading a prompt, its progress goes to the reply (promptProgress). The
        engine runs one request at a time, so a prompt read while our reply waits is ours or one
        queued before it."""
        progress = snap.get("prefill")
        if progress and self._reply is not None and self._meter is not None and not self._meter.text:
            self.promptProgress.emit(self._reply.id, int(progress["processed"]), int(progress["total"]))

    def _on_chunk(self, chunk: dict) -> None:
        if self._meter is None or self._reply is None:
            return
        if self._meter.feed(chunk) and not self._flush_timer.isActive():
            self._flush_timer.start()

    def _flush(self) -> None:
        """Checkpoint, then show: text reaches the screen only after it is in the database, so a
        crash of the app or the engine loses nothing that was shown (at most FLUSH_MS of text
        that was not shown yet)."""
        if self._meter is None or self._reply is None:
            return
        self.store.update_message(self._reply.id, content=self._meter.text)
        self._reply.content = self._meter.text
        self.messageChanged.emit(self._reply)

    def _on_ended(self, outcome: str, error: str) -> None:
        self._flush_timer.stop()
        if self._reply is None or self._meter is None:
            self._detach()
            return
        stats = self._meter.stats()
        status = {"done": "done", "stopped": "stopped"}.get(outcome, "interrupted")
        if error:
            stats["error"] = error
            log.warning("reply %s: %s", status, error)
        self.store.update_message(self._reply.id, content=self._meter.text, status=status, stats=stats)
        reply = self.store.message(self._reply.id)
        self._detach()
        if reply is not None:
            self.messageChanged.emit(reply)
        if error and outcome == "failed" and not self._meter_text_nonempty(reply):
            self.error.emit(error)

    @staticmethod
    def _meter_text_nonempty(reply: Message | None) -> bool:
        return bool(reply and reply.content)

    def _detach(self) -> None:
        if self._stream is not None:
            self._stream.deleteLater()
        self._stream = self._meter = self._reply = None
        self.busyChanged.emit(False)

    def shutdown(self) -> None:
        """Stops a reply in progress and writes what it has (app closing)."""
        self._flush_timer.stop()
        if self._reply is not None and self._meter is not None:
            self.store.update_message(self._reply.id, content=self._meter.text, status="stopped",
                                      stats=self._meter.stats())
        if self._stream is not None:
            self._stream.stop()
            self._stream.chunk.disconnect()
            self._stream.ended.disconnect()
        self._stream = self._meter = self._reply = None
