"""Renders the README's screenshots: the setup wizard, a chat and the dashboard after a short
real generation on the demo model. Usage (from the repository root):

    xvfb-run -a -s "-screen 0 1400x900x24" .venv/bin/python scripts/screenshots.py
    QT_QPA_PLATFORM=offscreen .venv/bin/python scripts/screenshots.py   # also works

It uses a throwaway data folder (your chats and presets are not touched) and the demo model
in the user cache (written on first use, ~20 s). Images go to docs/screenshots/.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


from PySide6.QtCore import QEventLoop  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402


def wait_until(app, cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise SystemExit(f"screenshots: timed out waiting for {what}")
        app.processEvents(QEventLoop.AllEvents, 20)
        time.sleep(0.005)


def settle(app, seconds: float = 0.4) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        app.processEvents(QEventLoop.AllEvents, 20)
        time.sleep(0.01)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    p.add_argument("--model", help="GGUF to use instead of the demo model")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    qapp = QApplication.instance() or QApplication(["moestudio"])
    QApplication.setApplicationDisplayName("MoE Studio")

    from app.main import MainWindow
    from app.paths import AppPaths

    paths = AppPaths.under(Path(tempfile.mkdtemp(prefix="moestudio-shots-"))).ensure()
    win = MainWindow(paths)
    win.resize(1320, 860)
    win.show()
    wait_until(qapp, lambda: win.wizard is not None, 10, "the wizard")
    wiz = win.wizard
    wiz.resize(900, 660)
    wait_until(qapp, wiz.hardware_page.isComplete, 90, "the hardware probe")
    settle(qapp)
    wiz.grab().save(str(args.out / "wizard-hardware.png"))
    wiz.next()
    if args.model:
        wiz.model_page.path.setText(args.model)
    else:
        wiz.model_page.use_demo()
    wait_until(qapp, wiz.model_page.isComplete, 300, "the model summary")
    settle(qapp)
    wiz.grab().save(str(args.out / "wizard-model.png"))
    wiz.next()
    wait_until(qapp, wiz.plan_page.isComplete, 60, "the plan")
    settle(qapp)
    wiz.grab().save(str(args.out / "wizard-plan.png"))
    wiz.next()
    wiz.summary_page.name.setText("demo")
    wiz.accept()
    wait_until(qapp, lambda: win.engine.state.value == "ready", 180, "the engine")

    chat = win.chat
    chat.settings_btn.setChecked(True)
    chat.system_prompt.setPlainText("You are a concise assistant.")
    chat.max_tokens.setValue(160)
    chat.seed.setValue(3)
    chat.input.setPlainText("Explain in two sentences what a Mixture-of-Experts model is, then show a Python "
                            "snippet that picks the top-2 experts.")
    chat.submit()
    chat.max_tokens.setValue(200)
    wait_until(qapp, lambda: not win.chat_ctl.busy, 180, "the reply")
    chat.input.setPlainText("And how does the expert cache decide what stays on the GPU?")
    chat.submit()
    wait_until(qapp, lambda: not win.chat_ctl.busy, 180, "the second reply")
    settle(qapp, 1.0)
    win.grab().save(str(args.out / "chat.png"))

    win.tabs.setCurrentWidget(win.dashboard)
    chat.max_tokens.setValue(400)
    chat.input.setPlainText("Write a long story about routers and experts.")
    chat.submit()
    wait_until(qapp, lambda: not win.chat_ctl.busy, 240, "the long reply")
    settle(qapp, 2.5)
    win.dashboard.redraw()
    settle(qapp, 0.3)
    win.grab().save(str(args.out / "dashboard.png"))

    win.tabs.setCurrentWidget(win.settings_panel)
    settle(qapp)
    win.grab().save(str(args.out / "settings.png"))
    win.close()
    print(f"screenshots written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
