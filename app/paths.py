"""Where the app keeps its files (platformdirs): config (presets, API key, app settings),
data (the chat database, the models folder and the model library's state), logs (rotating
engine and app logs). No Qt."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from platformdirs import PlatformDirs

APP_NAME = "moestudio"


@dataclass(frozen=True)
class AppPaths:
    config: Path
    data: Path
    log: Path

    @classmethod
    def default(cls) -> AppPaths:
        d = PlatformDirs(APP_NAME)  # as engine/config.py and engine/synth/demo.py call platformdirs
        return cls(Path(d.user_config_dir), Path(d.user_data_dir), Path(d.user_log_dir))

    @classmethod
    def under(cls, root: Path) -> AppPaths:
        """Everything below one folder (tests, portable installs)."""
        root = Path(root)
        return cls(root / "config", root / "data", root / "log")

    def ensure(self) -> AppPaths:
        for p in (self.config, self.data, self.log, self.models):
            p.mkdir(parents=True, exist_ok=True)
        return self

    @property
    def chat_db(self) -> Path:
        return self.data / "chats.sqlite3"

    @property
    def api_key_file(self) -> Path:
        return self.config / "api_key"

    @property
    def settings_file(self) -> Path:
        return self.config / "app.json"

    @property
    def presets(self) -> Path:
        return self.config / "presets"

    @property
    def models(self) -> Path:
        """The models folder: downloads land here, and every GGUF in it is in the library."""
        return self.data / "models"

    @property
    def library_file(self) -> Path:
        return self.data / "library.json"
