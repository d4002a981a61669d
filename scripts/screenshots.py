"""Renders the README's screenshots: the setup wizard, then the chat, models, dashboard, logs,
settings and API tabs at 1280x800 and at 1024x640 (the small size the layout must fit without clipping) after a
short real generation on the demo model. Usage (from the repository root):

    xvfb-run -a -s "-screen 0 1400x900x24" .venv/bin/python scripts/screenshots.py
    QT_QPA_PLATFORM=offscreen .venv/bin/python scripts/screenshots.py   # also works

It uses a throwaway data folder (your chats and presets are not touched) and the demo model
in the user cache (written on first use, ~20 s). Images go to docs/screenshots/: NAME.png at
1280x800 and NAME-1024x640.png.

Which engine the pictures show is chosen, not left to the machine: `--engine hybrid` (the
default: the MoE Studio engine, whose dashboard has the expert panels) even where `auto` would
pick llama.cpp (no CUDA GPU); `--engine auto` or `llamacpp` for the llama.cpp layout. The
engine shown, and why, is printed at the end.
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

from engine.config import ENGINES  # noqa: E402


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


SIZES = ((1280, 800), (1024, 640))


def grab_tabs(qapp, win, out: Path, size: tuple[int, int], suffix: str) -> None:
    win.resize(*size)
    settle(qapp)
    if (win.width(), win.height()) != size:
        raise SystemExit(f"screenshots: the window is {win.width()}x{win.height()}, not {size[0]}x{size[1]}: "
                         "something's minimum size is too large")
    for name, tab in (("chat", win.chat), ("models", win.models_panel), ("dashboard", win.dashboard),
                      ("logs", win.logs), ("settings", win.settings_panel), ("api", win.api_panel)):
        win.tabs.setCurrentWidget(tab)
        settle(qapp, 0.5)
        if tab is win.dashboard:
            win.dashboard.redraw()
            settle(qapp, 0.3)
        win.grab().save(str(out / f"{name}{suffix}.png"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    p.add_argument("--model", help="GGUF to use instead of the demo model")
    p.add_argument("--engine", choices=ENGINES, default="hybrid",
                   help="the engine setting the wizard saves (default: hybrid, the MoE Studio engine)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    qapp = QApplication.instance() or QApplication(["moestudio"])
    QApplication.setApplicationDisplayName("MoE Studio")

    from app.main import MainWindow
    from app.paths import AppPaths

    paths = AppPaths.under(Path(tempfile.mkdtemp(prefix="moestudio-shots-"))).ensure()
    win = MainWindow(paths)
    win.resize(*SIZES[0])
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
    wiz.plan_page.engine.setCurrentText(args.engine)
    plan = wiz.plan_page  # re-priced for the engine setting: its sentence says what runs and why
    wait_until(qapp, lambda: plan.isComplete() and args.engine in ("auto", plan.plan["engine"]), 60, "the plan")
    settle(qapp)
    wiz.grab().save(str(args.out / "wizard-plan.png"))
    wiz.next()
    wiz.summary_page.name.setText("demo")
    wiz.accept()
    wait_until(qapp, lambda: win.engine.state.value == "ready", 180, "the engine")
    shown = win.engine.health or {}
    if args.engine != "auto" and shown.get("engine") != args.engine:
        raise SystemExit(f"screenshots: asked for the {args.engine} engine, the worker runs {shown.get('engine')}")

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
    chat.regen_btn.click()  # a second version of the last reply: the ‹ 2/2 › browser shows
    wait_until(qapp, lambda: not win.chat_ctl.busy, 180, "the regenerated reply")

    win.tabs.setCurrentWidget(win.dashboard)  # the dashboard watches a longer reply as it streams
    chat.max_tokens.setValue(400)
    win.chat_ctl.new_conversation()
    win.chat_ctl.rename(win.chat_ctl.current.id, "A long story about routers, experts and the caches that keep "
                        "them close, told slowly")
    chat.input.setPlainText("Write a long story about routers and experts.")
    chat.submit()
    wait_until(qapp, lambda: not win.chat_ctl.busy, 240, "the long reply")
    settle(qapp, 2.5)
    win.chat_ctl.open(win.chat_ctl.conversations()[1].id)  # back to the first chat for the chat pictures
    for size, suffix in zip(SIZES, ("", "-1024x640")):
        grab_tabs(qapp, win, args.out, size, suffix)
    win.close()
    print(f"screenshots written to {args.out}: the {shown.get('engine')} engine "
          f"({shown.get('engine_reason')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
