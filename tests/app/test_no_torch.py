"""app/ is the GUI only: importing any of it must not load torch, and the model/state modules
must not load Qt either (napari/Anki style: state without Qt, Qt in its own modules)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PURE = ["app.paths", "app.address", "app.library", "app.downloads", "app.credentials", "app.worker_state", "app.log_buffer", "app.logs", "app.api_client",
        "app.store", "app.settings", "app.chat.session", "app.chat.markdown", "app.dashboard.series",
        "app.desktop_entry"]  # install-desktop runs before any Qt GUI and must stay cheap


def _modules() -> list[str]:
    out = []
    for p in sorted((ROOT / "app").rglob("*.py")):
        rel = p.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append(".".join(parts))
    return out


def _loaded(modules: list[str]) -> dict:
    code = ("import importlib, json, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(json.dumps({'torch': 'torch' in sys.modules, 'qt': 'PySide6.QtCore' in sys.modules}))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "QT_QPA_PLATFORM": "offscreen"})
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_no_app_module_imports_torch():
    mods = _modules()
    assert "app.main" in mods and "app.dashboard.widgets" in mods
    assert _loaded(mods)["torch"] is False


def test_state_modules_carry_no_qt():
    assert _loaded(PURE) == {"torch": False, "qt": False}


def test_moestudio_without_subcommand_opens_the_app_without_torch():
    code = ("import sys\nimport app.main\n"
            "app.main.main = lambda argv=None: print('app', 'torch' in sys.modules) or 0\n"
            "from engine.cli import main\nsys.exit(main([]))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "app False", res.stderr


def test_reading_the_model_library_loads_no_torch(make_model, tmp_path):
    """The Models tab reads GGUF headers in the app process: with the engine's parser, without torch."""
    code = ("import json, sys\nfrom pathlib import Path\nfrom app.library import ModelLibrary\n"
            f"lib = ModelLibrary(Path({str(tmp_path)!r}), Path({str(tmp_path / 'lib.json')!r}))\n"
            f"lib.add({str(make_model('qwen3moe'))!r})\n"
            "e = lib.entries()[0]\n"
            "print(json.dumps({'torch': 'torch' in sys.modules, 'arch': e.info.arch}))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {"torch": False, "arch": "qwen3moe"}
