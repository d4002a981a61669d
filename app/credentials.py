"""The API key the app gives its engine worker: generated once (or set by the user in the API tab),
kept readable by this user only."""
from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from engine.errors import UserError


def _private_folder(folder: Path) -> None:
    """The key's folder (the app's config folder) is this user's only: it also holds presets, which may
    carry a key of their own, and nobody else needs to list it. AppPaths.ensure() creates it with the
    umask's mode (usually 0755), so it is tightened here, where the secret is written."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if stat.S_IMODE(folder.stat().st_mode) & 0o077:
        os.chmod(folder, 0o700)


def load_or_create_api_key(path: Path) -> str:
    path = Path(path)
    _private_folder(path.parent)
    try:
        key = path.read_text(encoding="utf-8").strip()
        if key:
            if stat.S_IMODE(path.stat().st_mode) & 0o077:
                os.chmod(path, 0o600)  # someone loosened it: tighten again
            return key
    except FileNotFoundError:
        pass
    return save_api_key(path, new_api_key())


def new_api_key() -> str:
    return secrets.token_urlsafe(32)


def save_api_key(path: Path, key: str) -> str:
    """Writes the key (a user's own or a new one) readable by this user only; returns it."""
    key = key.strip()
    if not key or any(c.isspace() for c in key):
        raise UserError("API key: give non-empty text without spaces")
    path = Path(path)
    _private_folder(path.parent)
    tmp = path.with_name(path.name + ".new")
    tmp.unlink(missing_ok=True)  # a leftover could have any mode: O_EXCL makes a fresh 0600 file
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, key.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return key
