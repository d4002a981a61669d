"""The API key the app gives its engine worker: generated once, kept readable by this user only."""
from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path


def load_or_create_api_key(path: Path) -> str:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        key = path.read_text(encoding="utf-8").strip()
        if key:
            if stat.S_IMODE(path.stat().st_mode) & 0o077:
                os.chmod(path, 0o600)  # someone loosened it: tighten again
            return key
    except FileNotFoundError:
        pass
    key = secrets.token_urlsafe(32)
    tmp = path.with_name(path.name + ".new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, key.encode())
    finally:
        os.close(fd)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return key
