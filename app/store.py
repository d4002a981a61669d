"""Chats in SQLite (WAL) under the platformdirs data dir. No Qt.

Crash safety: every change is its own committed transaction; a streaming reply is written as it
grows (the chat controller checkpoints it every 100 ms), with status "streaming" until it
ends. A database opened after a crash turns leftover "streaming" rows into "interrupted":
the text that was shown is there, and the chat says the reply was cut off.

Regenerating a reply keeps the earlier versions (reply_versions): the message row holds the
version shown, numbered `version`; the others wait in reply_versions under their numbers, and
showing one swaps it with the message row.

Deleting a conversation deletes its rows (foreign keys cascade) with `secure_delete` on, so the
text is overwritten in the file rather than left in free pages.
"""
from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 2
STATUSES = ("done", "streaming", "stopped", "interrupted", "error")

_SCHEMA_V1 = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE conversations(
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: a deleted message id stays dead
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    settings TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE messages(
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: a deleted message id stays dead
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
    content TEXT NOT NULL,
    status TEXT NOT NULL DEFAULT 'done',
    stats TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
"""
_SCHEMA_V2 = """
ALTER TABLE messages ADD COLUMN version INTEGER NOT NULL DEFAULT 1;  -- the number of the version shown
CREATE TABLE reply_versions(  -- the versions of a regenerated reply that are not shown
    message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
    version INTEGER NOT NULL,
    content TEXT NOT NULL,
    status TEXT NOT NULL,
    stats TEXT,
    PRIMARY KEY (message_id, version)
);
"""
# version -> SQL that brings the previous version up to it
MIGRATIONS: dict[int, str] = {1: _SCHEMA_V1, 2: _SCHEMA_V2}
_MESSAGE_COLUMNS = "m.*, 1 + (SELECT COUNT(*) FROM reply_versions v WHERE v.message_id = m.id) AS versions"


@dataclass
class Conversation:
    id: int
    title: str
    system_prompt: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0
    updated: float = 0.0


@dataclass
class Message:
    id: int
    conversation_id: int
    role: str
    content: str
    status: str = "done"
    stats: dict[str, Any] | None = None
    created: float = 0.0
    version: int = 1  # which version of a regenerated reply this is
    versions: int = 1  # how many versions the reply has


class SchemaTooNew(Exception):
    pass


class ChatStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # with WAL: an app crash loses no commit
        self.db.execute("PRAGMA foreign_keys=ON")
        self.db.execute("PRAGMA secure_delete=ON")
        self.db.execute("PRAGMA busy_timeout=3000")
        self._migrate()
        self.recovered = self._recover_interrupted()

    # ---- schema -------------------------------------------------------------------------
    def schema_version(self) -> int:
        return int(self.db.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        current = self.schema_version()
        if current > SCHEMA_VERSION:
            raise SchemaTooNew(f"{self.path} was written by a newer MoE Studio (schema {current}, "
                               f"this one knows {SCHEMA_VERSION})")
        for version in range(current + 1, SCHEMA_VERSION + 1):
            with self._tx():
                for stmt in _statements(MIGRATIONS[version]):
                    self.db.execute(stmt)
                self.db.execute(f"PRAGMA user_version={version}")
                self.db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('schema_version', ?)",
                                (str(version),))

    def _tx(self):
        return _Transaction(self.db)

    def _recover_interrupted(self) -> int:
        cur = self.db.execute("UPDATE messages SET status='interrupted' WHERE status='streaming'")
        return cur.rowcount

    def close(self) -> None:
        try:
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error:
            pass
        self.db.close()

    # ---- conversations -------------------------------------------------------------------
    def create_conversation(self, title: str = "New chat", system_prompt: str = "",
                            settings: dict[str, Any] | None = None) -> Conversation:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO conversations(title, system_prompt, settings, created, updated) VALUES (?,?,?,?,?)",
            (title, system_prompt, json.dumps(settings or {}), now, now))
        return self.conversation(cur.lastrowid)

    def conversation(self, conv_id: int) -> Conversation | None:
        row = self.db.execute("SELECT * FROM conversations WHERE id=?", (conv_id,)).fetchone()
        return _conversation(row) if row else None

    def conversations(self, search: str = "") -> list[Conversation]:
        if not search.strip():
            rows = self.db.execute("SELECT * FROM conversations ORDER BY updated DESC, id DESC").fetchall()
        else:
            like = "%" + search.strip().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            rows = self.db.execute(
                "SELECT * FROM conversations c WHERE c.title LIKE ? ESCAPE '\\' OR EXISTS "
                "(SELECT 1 FROM messages m WHERE m.conversation_id=c.id AND m.content LIKE ? ESCAPE '\\') "
                "ORDER BY updated DESC, id DESC", (like, like)).fetchall()
        return [_conversation(r) for r in rows]

    def rename(self, conv_id: int, title: str) -> None:
        self.db.execute("UPDATE conversations SET title=?, updated=? WHERE id=?",
                        (title.strip() or "Untitled", time.time(), conv_id))

    def update_conversation(self, conv_id: int, *, system_prompt: str | None = None,
                            settings: dict[str, Any] | None = None) -> None:
        if system_prompt is not None:
            self.db.execute("UPDATE conversations SET system_prompt=? WHERE id=?", (system_prompt, conv_id))
        if settings is not None:
            self.db.execute("UPDATE conversations SET settings=? WHERE id=?", (json.dumps(settings), conv_id))

    def delete_conversation(self, conv_id: int) -> None:
        with self._tx():
            self.db.execute("DELETE FROM messages WHERE conversation_id=?", (conv_id,))
            self.db.execute("DELETE FROM conversations WHERE id=?", (conv_id,))
        try:  # move the overwritten pages out of the WAL into the main file too
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error:
            pass

    def _touch(self, conv_id: int) -> None:
        self.db.execute("UPDATE conversations SET updated=? WHERE id=?", (time.time(), conv_id))

    # ---- messages ------------------------------------------------------------------------
    def messages(self, conv_id: int) -> list[Message]:
        rows = self.db.execute(f"SELECT {_MESSAGE_COLUMNS} FROM messages m WHERE m.conversation_id=? ORDER BY m.id",
                               (conv_id,)).fetchall()
        return [_message(r) for r in rows]

    def message(self, msg_id: int) -> Message | None:
        row = self.db.execute(f"SELECT {_MESSAGE_COLUMNS} FROM messages m WHERE m.id=?", (msg_id,)).fetchone()
        return _message(row) if row else None

    def add_message(self, conv_id: int, role: str, content: str, status: str = "done",
                    stats: dict[str, Any] | None = None) -> Message:
        assert status in STATUSES, status
        now = time.time()
        with self._tx():
            cur = self.db.execute(
                "INSERT INTO messages(conversation_id, role, content, status, stats, created, updated) "
                "VALUES (?,?,?,?,?,?,?)",
                (conv_id, role, content, status, json.dumps(stats) if stats is not None else None, now, now))
            self._touch(conv_id)
        return self.message(cur.lastrowid)

    def update_message(self, msg_id: int, *, content: str | None = None, status: str | None = None,
                       stats: dict[str, Any] | None = None) -> None:
        sets, args = ["updated=?"], [time.time()]
        if content is not None:
            sets.append("content=?"); args.append(content)
        if status is not None:
            assert status in STATUSES, status
            sets.append("status=?"); args.append(status)
        if stats is not None:
            sets.append("stats=?"); args.append(json.dumps(stats))
        self.db.execute(f"UPDATE messages SET {', '.join(sets)} WHERE id=?", (*args, msg_id))

    def new_version(self, msg_id: int) -> Message:
        """Keeps the reply shown as an earlier version and empties the row for a new one (regenerate)."""
        msg = self.message(msg_id)
        with self._tx():
            self._archive(msg)
            self.db.execute("UPDATE messages SET content='', status='streaming', stats=NULL, version=?, updated=? "
                            "WHERE id=?", (msg.versions + 1, time.time(), msg_id))
            self._touch(msg.conversation_id)
        return self.message(msg_id)

    def show_version(self, msg_id: int, version: int) -> Message:
        """Shows another version of a reply (it becomes the one later turns continue from)."""
        msg = self.message(msg_id)
        if version == msg.version:
            return msg
        row = self.db.execute("SELECT * FROM reply_versions WHERE message_id=? AND version=?",
                              (msg_id, version)).fetchone()
        if row is None:
            raise KeyError(f"message {msg_id} has no version {version}")
        with self._tx():
            self._archive(msg)
            self.db.execute("DELETE FROM reply_versions WHERE message_id=? AND version=?", (msg_id, version))
            self.db.execute("UPDATE messages SET content=?, status=?, stats=?, version=?, updated=? WHERE id=?",
                            (row["content"], row["status"], row["stats"], version, time.time(), msg_id))
        return self.message(msg_id)

    def other_versions(self, msg_id: int) -> list[Message]:
        """The versions of a reply that are not shown, oldest first (as Messages with their numbers)."""
        msg = self.message(msg_id)
        rows = self.db.execute("SELECT * FROM reply_versions WHERE message_id=? ORDER BY version", (msg_id,))
        return [Message(msg.id, msg.conversation_id, msg.role, r["content"], r["status"],
                        json.loads(r["stats"]) if r["stats"] else None, msg.created, r["version"], msg.versions)
                for r in rows]

    def _archive(self, msg: Message) -> None:
        self.db.execute("INSERT INTO reply_versions(message_id, version, content, status, stats) VALUES (?,?,?,?,?)",
                        (msg.id, msg.version, msg.content, msg.status,
                         json.dumps(msg.stats) if msg.stats is not None else None))

    def delete_messages_from(self, conv_id: int, msg_id: int) -> None:
        """Deletes this message and every later one of the conversation (regenerate, edit)."""
        self.db.execute("DELETE FROM messages WHERE conversation_id=? AND id>=?", (conv_id, msg_id))

    def count_rows(self) -> tuple[int, int]:
        c = self.db.execute("SELECT COUNT(*) FROM conversations").fetchone()[0]
        m = self.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0]
        return c, m


class _Transaction:
    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self):
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type, exc, tb):
        self.db.execute("COMMIT" if exc_type is None else "ROLLBACK")
        return False


def _statements(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]


def _conversation(r: sqlite3.Row) -> Conversation:
    return Conversation(r["id"], r["title"], r["system_prompt"], json.loads(r["settings"] or "{}"),
                        r["created"], r["updated"])


def _message(r: sqlite3.Row) -> Message:
    return Message(r["id"], r["conversation_id"], r["role"], r["content"], r["status"],
                   json.loads(r["stats"]) if r["stats"] else None, r["created"], r["version"], r["versions"])
