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
from engine.errors import UserError

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


@dataclass(frozen=True)
class ModelLimits:
    """What a model's header bounds among the settings."""
    path: str
    n_ctx_train: int | None
    n_expert: int


def model_limits(model: str | None) -> ModelLimits | None:
    """The limits of the model file, or None when there is none or it cannot be read (the engine
    then says why at its start)."""
    if not model or not Path(model).is_file():
        return None
    from app.library import read_model_info

    try:
        info = read_model_info(model)
    except (UserError, OSError, ValueError):
        return None
    return ModelLimits(model, info.n_ctx_train, info.n_expert)


def check_for_model(cfg: Config, limits: ModelLimits | None) -> str | None:
    """Why these settings would not run as written on this model, or None. The engine caps a
    context above the training length (engine/plan/sizing.resolve_ctx), so such a value would
    silently differ from what runs: the settings panel refuses or clamps it, saying so."""
    if limits is None:
        return None
    if limits.n_ctx_train and cfg.ctx > limits.n_ctx_train:
        return (f"ctx {cfg.ctx:,} is above this model's training context ({limits.n_ctx_train:,} tokens), "
                f"which is the most the engine runs: use at most {limits.n_ctx_train:,} (or 0 for exactly that)")
    size = cfg.moe_expert_cache_size
    if limits.n_expert and isinstance(size, int) and size > limits.n_expert:
        return (f"moe_expert_cache_size {size} is more slots than this model has experts per layer "
                f"({limits.n_expert}): use at most {limits.n_expert} (or all)")
    return None
