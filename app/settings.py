"""The app's own small state (not engine settings): which preset is current, recent models, the
API server's address.
A JSON file in the config dir, written atomically. No Qt. Engine settings live in presets
(TOML, engine/config.py's schema), so the GUI, `moestudio serve --preset` and files agree."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from engine.config import Config, read_toml, write_toml

from app.address import DEFAULT_API_HOST, DEFAULT_API_PORT

MAX_RECENT = 10


@dataclass
class AppSettings:
    current_preset: str | None = None
    recent_models: list[str] = field(default_factory=list)
    last_conversation: int | None = None
    api_host: str = DEFAULT_API_HOST  # the API server's fixed address (app/address.py)
    api_port: int = DEFAULT_API_PORT

    @classmethod
    def load(cls, path: Path) -> AppSettings:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (FileNotFoundError, ValueError):
            return cls()
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".new")
        tmp.write_text(json.dumps(asdict(self), indent=2), encoding="utf-8")
        os.replace(tmp, path)

    def add_recent(self, model: str) -> None:
        model = str(model)
        self.recent_models = [model] + [m for m in self.recent_models if m != model]
        del self.recent_models[MAX_RECENT:]


def preset_file(presets_dir: Path, name: str) -> Path:
    from engine.config import preset_path  # validates the name

    return Path(presets_dir) / preset_path(name).name


def read_preset(presets_dir: Path, name: str) -> Config:
    return Config(**read_toml(preset_file(presets_dir, name)))


def write_preset(presets_dir: Path, name: str, cfg: Config) -> Path:
    return write_toml(preset_file(presets_dir, name), cfg)


def list_presets(presets_dir: Path) -> list[str]:
    return sorted(p.stem for p in Path(presets_dir).glob("*.toml"))


def config_dict(cfg: Config) -> dict[str, Any]:
    return asdict(cfg)
