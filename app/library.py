"""The model library: the GGUF files the user has. No Qt, no torch.

Two sources: every .gguf below the models folder (platformdirs data dir/models, where downloads
land), and files opened from anywhere, which are remembered. Each entry carries what its header
says (name, architecture, expert count, tensor types), its size and when it was last used. The
header is read with the engine's own GGUF parser (engine/gguf/reader.py), which imports no torch
and reads a header in milliseconds; what was read is cached by path, size and mtime, so a
library of large files opens without touching them again. Whether a model fits this machine
comes from the planner, through the app's planner helper (app/plan_service.py), not from here.

A model split into shards (`name-00001-of-00003.gguf`) is one entry: its first shard, with the
size of all of them.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.errors import UserError

SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.I)
PARTIAL_SUFFIX = ".part"  # a download in progress (app/downloads.py); not a model yet


@dataclass(frozen=True)
class ModelInfo:
    """What a GGUF header says about the model."""
    name: str
    arch: str
    n_expert: int  # 0: a dense model
    n_expert_used: int
    n_ctx_train: int | None
    quant_types: tuple[str, ...]  # by bytes, largest first
    expert_quant_types: tuple[str, ...]

    @property
    def main_quant(self) -> str:
        return (self.expert_quant_types or self.quant_types or ("?",))[0]


@dataclass(frozen=True)
class ModelEntry:
    path: str
    size_bytes: int
    info: ModelInfo | None  # None when the file cannot be read (then `error` says why)
    error: str | None = None
    opened: bool = False  # remembered because the user opened it (not found in the models folder)
    last_used: float | None = None

    @property
    def display_name(self) -> str:
        return self.info.name if self.info else Path(self.path).name

    @property
    def label(self) -> str:
        """One line for pickers: name and main quant type."""
        return f"{self.display_name} ({self.info.main_quant})" if self.info else f"{Path(self.path).name} (unreadable)"


def human_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def read_model_info(path: str | os.PathLike[str]) -> ModelInfo:
    """The header's summary, or a UserError (GGUFError) saying why the file is not a usable model."""
    from engine.gguf.reader import ModelFile  # numpy and the gguf package only; kept out of app start

    mf = ModelFile.open(path)
    by_type: Counter[str] = Counter()
    expert_types: Counter[str] = Counter()
    for name, t in mf.tensors.items():
        by_type[t.qtype.name] += t.n_bytes
        if "_exps." in name:
            expert_types[t.qtype.name] += t.n_bytes
    name = mf.get("general.name")
    ctx = mf.get(f"{mf.arch}.context_length")
    return ModelInfo(name=name if isinstance(name, str) and name.strip() else _stem(Path(path)), arch=mf.arch,
                     n_expert=int(mf.get(f"{mf.arch}.expert_count", 0) or 0),
                     n_expert_used=int(mf.get(f"{mf.arch}.expert_used_count", 0) or 0),
                     n_ctx_train=int(ctx) if isinstance(ctx, int) else None,
                     quant_types=tuple(t for t, _ in by_type.most_common()),
                     expert_quant_types=tuple(t for t, _ in expert_types.most_common()))


def _stem(path: Path) -> str:
    return SHARD.sub("", path.name).removesuffix(".gguf")


def model_size(path: Path) -> int:
    """The file's size, or all its shards' for the first shard of a split model."""
    m = SHARD.search(path.name)
    if not m:
        return path.stat().st_size
    total = int(m.group(2))
    prefix = path.name[:m.start()]
    return sum((path.with_name(f"{prefix}-{i:05d}-of-{total:05d}.gguf").stat().st_size
                for i in range(1, total + 1)
                if path.with_name(f"{prefix}-{i:05d}-of-{total:05d}.gguf").is_file()), 0)


@dataclass
class _State:
    opened: list[str] = field(default_factory=list)
    last_used: dict[str, float] = field(default_factory=dict)
    headers: dict[str, dict] = field(default_factory=dict)  # path -> {"size", "mtime", "info" | "error"}


class ModelLibrary:
    """The library's state file (JSON, written atomically) and the listing."""

    def __init__(self, models_dir: Path, state_file: Path):
        self.models_dir, self.state_file = Path(models_dir), Path(state_file)
        self._lock = threading.RLock()  # entries() runs on a worker thread, changes on the GUI thread
        self._state = self._load()

    def _load(self) -> _State:
        try:
            data = json.loads(self.state_file.read_text(encoding="utf-8"))
            return _State(opened=[str(p) for p in data.get("opened", [])],
                          last_used={str(k): float(v) for k, v in data.get("last_used", {}).items()},
                          headers=dict(data.get("headers", {})))
        except (FileNotFoundError, ValueError, TypeError, AttributeError):
            return _State()  # a missing or damaged file: the folder scan rebuilds what matters

    def _save(self) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_name(self.state_file.name + ".new")
        tmp.write_text(json.dumps(asdict(self._state), indent=1), encoding="utf-8")
        os.replace(tmp, self.state_file)

    # ---- listing ---------------------------------------------------------------------------------
    def folder_files(self) -> list[Path]:
        if not self.models_dir.is_dir():
            return []
        files = []
        for p in sorted(self.models_dir.rglob("*.gguf")):
            m = SHARD.search(p.name)
            if p.is_file() and (not m or int(m.group(1)) == 1):
                files.append(p)
        return files

    def entries(self) -> list[ModelEntry]:
        """Every model, most recently used first, then by name. Reads the headers it has not seen
        (call it off the GUI thread: a new large file costs a few milliseconds to map)."""
        with self._lock:
            seen: dict[str, bool] = {}
            for p in self.folder_files():
                seen[str(p.resolve())] = False
            for p in self._state.opened:
                seen.setdefault(p, True)
            out = [self._entry(Path(p), opened) for p, opened in seen.items()]
            # what is gone from the folder is forgotten (opened files stay, shown as missing)
            self._state.headers = {k: v for k, v in self._state.headers.items() if k in seen}
            self._state.last_used = {k: v for k, v in self._state.last_used.items() if k in seen}
            self._save()
        return sorted(out, key=lambda e: (-(e.last_used or 0), e.display_name.lower()))

    def _entry(self, path: Path, opened: bool) -> ModelEntry:
        key = str(path)
        used = self._state.last_used.get(key)
        try:
            st = path.stat()
            size = model_size(path)
        except OSError:
            return ModelEntry(key, 0, None, "the file is missing (moved or deleted?)", opened, used)
        cached = self._state.headers.get(key)
        if not (cached and cached.get("size") == st.st_size and cached.get("mtime") == st.st_mtime):
            try:
                cached = {"size": st.st_size, "mtime": st.st_mtime, "info": asdict(read_model_info(path))}
            except (UserError, OSError, ValueError) as e:
                cached = {"size": st.st_size, "mtime": st.st_mtime, "error": str(e)}
            self._state.headers[key] = cached
        if "info" in cached:
            info = cached["info"]
            info = ModelInfo(**{**info, "quant_types": tuple(info["quant_types"]),
                                "expert_quant_types": tuple(info["expert_quant_types"])})
            return ModelEntry(key, size, info, None, opened, used)
        return ModelEntry(key, size, None, cached["error"], opened, used)

    # ---- changes ---------------------------------------------------------------------------------
    def add(self, path: str | os.PathLike[str]) -> ModelEntry:
        """Remembers a file opened from anywhere; a UserError if it is not a readable GGUF model."""
        p = Path(path).expanduser().resolve()
        if not p.is_file():
            raise UserError(f"{p} is not a file")
        with self._lock:
            entry = self._entry(p, opened=True)
            if entry.error:
                self._save()
                raise UserError(f"{p.name} cannot be added to the library: {entry.error}")
            if str(p) not in self._state.opened and not self._in_folder(p):
                self._state.opened.append(str(p))
            self._save()
        return entry

    def forget(self, path: str) -> None:
        """Drops an opened file from the list (the file itself stays where it is)."""
        with self._lock:
            self._state.opened = [p for p in self._state.opened if p != path]
            self._state.last_used.pop(path, None)
            self._state.headers.pop(path, None)
            self._save()

    def mark_used(self, path: str | os.PathLike[str], when: float | None = None) -> None:
        p = Path(path).expanduser().resolve()
        with self._lock:
            if str(p) not in self._state.opened and not self._in_folder(p):
                self._state.opened.append(str(p))
            self._state.last_used[str(p)] = time.time() if when is None else when
            self._save()

    def _in_folder(self, p: Path) -> bool:
        return p.is_relative_to(self.models_dir.resolve())
