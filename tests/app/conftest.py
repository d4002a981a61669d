"""GUI test fixtures: offscreen Qt, an isolated app data tree, and waiting helpers."""
from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from app.paths import AppPaths  # noqa: E402


@pytest.fixture
def app_paths(tmp_path) -> AppPaths:
    return AppPaths.under(tmp_path / "moestudio").ensure()
