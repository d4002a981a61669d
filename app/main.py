"""The main window and `main()`: what `moestudio` (no subcommand) and `./dev.sh app` open.

Tabs: Chat, Models, Dashboard, Logs, Settings, API. The Engine menu holds the setup wizard, start,
stop, restart and cancel; the status bar shows the engine's state, load progress and address.
First run (no preset yet) opens the wizard, which offers the demo model. Errors go to a dialog
with a "Copy details" button and to app.log, never to a bare traceback.
"""
from __future__ import annotations


import logging
import os
import re
import sys
import traceback
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, QUrl
from PySide6.QtGui import QAction, QDesktopServices, QGuiApplication, QIcon, QKeySequence
from PySide6.QtWidgets import (QApplication, QLabel, QMainWindow, QMessageBox, QProgressBar, QPushButton,
                               QTabWidget)

from engine.config import Config
from engine.errors import UserError

from app.address import check_address
from app.api_panel import ApiPanel
from app.chat.controller import ChatController
from app.chat.widgets import ChatWidget
from app.credentials import save_api_key
from app.dashboard.streamer import StatsStreamer
from app.dashboard.widgets import DashboardWidget
from app.desktop_entry import APP_ID, ICON_SVG
from app.dialogs import CrashDialog, ErrorDialog
from app.engine_manager import EngineManager, LaunchSpec, default_command
from app.library import ModelEntry, ModelLibrary
from app.logs import APP_LOG, setup_logging
from app.logs_widget import LogsWidget
from app.models_panel import ModelsPanel
from app.paths import AppPaths
from app.plan_service import PlanService
from app.settings import AppSettings, list_presets, preset_file, read_preset, write_preset
from app.settings_panel import SettingsPanel
from app.single_instance import SingleInstance
from app.store import ChatStore
from app.tasks import TaskManager
from app.wizard import SetupWizard
from app.worker_state import Crash, State

log = logging.getLogger(APP_LOG)
STATE_TEXT = {State.STOPPED: "Engine stopped", State.STARTING: "Engine starting", State.LOADING: "Loading the model",
              State.READY: "Engine ready", State.STOPPING: "Engine stopping", State.CRASHED: "Engine crashed"}


class MainWindow(QMainWindow):
    def __init__(self, paths: AppPaths | None = None, *, autostart: bool = True, show_wizard_if_needed: bool = True,
                 extra_args: tuple[str, ...] = (), command=default_command, max_restarts: int = 3):
        super().__init__()
        self.paths = (paths or AppPaths.default()).ensure()
        self.extra_args = tuple(extra_args)
        setup_logging(self.paths.log)
        self.settings = AppSettings.load(self.paths.settings_file)
        self.tasks = TaskManager(self)
        self.engine = EngineManager(self.paths, self.tasks, self, command=command, max_restarts=max_restarts)
        self.store = ChatStore(self.paths.chat_db)
        if self.store.recovered:
            log.info("%d reply(ies) cut off by the last exit are marked interrupted", self.store.recovered)
        self.chat_ctl = ChatController(self.store, self.tasks, self._client, self)
        self.library = ModelLibrary(self.paths.models, self.paths.library_file)
        self.plan_service: PlanService | None = None
        self.wizard: SetupWizard | None = None
        self.crash_dialog: CrashDialog | None = None
        self.port_dialog: QMessageBox | None = None
        self._closing = False

        if ICON_SVG.is_file():
            self.setWindowIcon(QIcon(str(ICON_SVG)))
        self.resize(1280, 820)
        self.tabs = QTabWidget()
        self.chat = ChatWidget(self.chat_ctl)
        self.models_panel = ModelsPanel(self.library, self.tasks)
        self.dashboard = DashboardWidget()
        self.logs = LogsWidget(self.engine.logs, self.paths.log)
        self.settings_panel = SettingsPanel()
        self.api_panel = ApiPanel()
        self.tabs.addTab(self.chat, "Chat")
        self.tabs.addTab(self.models_panel, "Models")
        self.tabs.addTab(self.dashboard, "Dashboard")
        self.tabs.addTab(self.logs, "Logs")
        self.tabs.addTab(self.settings_panel, "Settings")
        self.tabs.addTab(self.api_panel, "API")
        self.setCentralWidget(self.tabs)
        self.streamer = StatsStreamer(self)
        self.streamer.snapshot.connect(self.dashboard.ingest)
        self.streamer.snapshot.connect(self.chat_ctl.on_stats)  # "processing prompt 1,536 / 4,000"

        self._build_menu()
        self._build_status_bar()
        self.engine.stateChanged.connect(self._state_changed)
        self.engine.progressChanged.connect(self._progress)
        self.engine.logLine.connect(self.logs.append)
        self.engine.crashed.connect(self._crashed)
        self.engine.ready.connect(self._ready)
        self.engine.portBusy.connect(self._port_busy)
        self.settings_panel.applyRequested.connect(self._apply_settings)
        self.api_panel.applyRequested.connect(self._apply_address)
        self.models_panel.modelsChanged.connect(self._models_changed)
        self.models_panel.useRequested.connect(self.use_model)
        self.chat.modelChosen.connect(self.use_model)
        self._load_preset_into_panel()
        self._show_address()
        self._state_changed(self.engine.state.value)
        self.models_panel.refresh()

        convs = self.store.conversations()
        last = self.settings.last_conversation
        if last and any(c.id == last for c in convs):
            self.chat_ctl.open(last)
        elif convs:
            self.chat_ctl.open(convs[0].id)
        if autostart and self.current_config() is not None:
            QTimer.singleShot(0, self.start_engine)
        elif show_wizard_if_needed and self.current_config() is None:
            QTimer.singleShot(0, self.open_wizard)

    # ---- presets ---------------------------------------------------------------------------------
    def current_config(self) -> Config | None:
        name = self.settings.current_preset
        if not name:
            return None
        try:
            return read_preset(self.paths.presets, name)
        except (UserError, OSError) as e:
            log.warning("preset %s unreadable: %s", name, e)
            return None

    def _load_preset_into_panel(self) -> None:
        cfg = self.current_config()
        self.settings_panel.set_config(cfg, self.settings.current_preset)
        self.setWindowTitle(f"{Path(cfg.model).name} \u2014 MoE Studio" if cfg and cfg.model else "MoE Studio")
        model = str(Path(cfg.model).resolve()) if cfg and cfg.model else None
        self.models_panel.set_current(model)
        self._models_changed(self.models_panel.entries)

    def _save_preset(self, name: str, cfg: Config) -> None:
        write_preset(self.paths.presets, name, cfg)
        self.settings.current_preset = name
        if cfg.model:
            self.settings.add_recent(cfg.model)
        self.settings.save(self.paths.settings_file)
        self._load_preset_into_panel()

    # ---- models ---------------------------------------------------------------------------------------
    def _models_changed(self, entries: list[ModelEntry]) -> None:
        self.chat.set_models([(e.path, e.label) for e in entries if e.info], self.models_panel.current_model)

    def use_model(self, path: str) -> None:
        """Runs the engine on this model: with the preset that already names it, else a new preset
        for it with every option at its default (auto sizes itself to the model)."""
        path = str(Path(path).resolve())
        cfg = self.current_config()
        if cfg and cfg.model and str(Path(cfg.model).resolve()) == path and self.engine.state.running:
            return
        name = self._preset_for(path)
        try:
            if name is None:
                name = self._new_preset_name(path)
                write_preset(self.paths.presets, name, Config(model=path))
            self.settings.current_preset = name
            self.settings.add_recent(path)
            self.settings.save(self.paths.settings_file)
        except (UserError, OSError) as e:
            self.show_error("Could not switch the model", str(e))
            return
        log.info("model chosen: %s (preset %s)", path, name)
        self._load_preset_into_panel()
        self.engine.spec = None
        self.engine.shutdown()
        self.start_engine()

    def _preset_for(self, model: str) -> str | None:
        names = list_presets(self.paths.presets)
        current = self.settings.current_preset
        for name in ([current] if current in names else []) + [n for n in names if n != current]:
            try:
                cfg = read_preset(self.paths.presets, name)
            except (UserError, OSError):
                continue
            if cfg.model and str(Path(cfg.model).resolve()) == model:
                return name
        return None

    def _new_preset_name(self, model: str) -> str:
        base = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(model).stem).strip("-._")[:56] or "model"
        names = set(list_presets(self.paths.presets))
        return next(n for n in (base if i == 1 else f"{base}-{i}" for i in range(1, 10_000)) if n not in names)

    # ---- menu and status bar -----------------------------------------------------------------------
    def _build_menu(self) -> None:
        m = self.menuBar()
        file = m.addMenu("&File")
        self.act_new_chat = QAction("&New chat", self, shortcut=QKeySequence.New, triggered=self._new_chat)
        file.addAction(self.act_new_chat)
        file.addSeparator()
        file.addAction(QAction("&Quit", self, shortcut=QKeySequence.Quit, triggered=self.close))
        eng = m.addMenu("&Engine")
        self.act_wizard = QAction("&Setup wizard\u2026", self, triggered=self.open_wizard)
        self.act_start = QAction("&Start", self, triggered=self.start_engine)
        self.act_restart = QAction("&Restart", self, triggered=self.restart_engine)
        self.act_stop = QAction("S&top", self, triggered=self.engine.stop)
        self.act_cancel = QAction("&Cancel loading", self, triggered=self.engine.cancel_load)
        for a in (self.act_wizard, None, self.act_start, self.act_restart, self.act_stop, self.act_cancel):
            eng.addSeparator() if a is None else eng.addAction(a)
        helpm = m.addMenu("&Help")
        helpm.addAction(QAction("Open &log folder", self, triggered=lambda: QDesktopServices.openUrl(
            QUrl.fromLocalFile(str(self.paths.log)))))
        helpm.addAction(QAction("&About MoE Studio", self, triggered=self._about))

    def _build_status_bar(self) -> None:
        sb = self.statusBar()
        self.state_label = QLabel()
        self.progress_bar = QProgressBar()
        self.progress_bar.setMaximumWidth(260)
        self.progress_bar.setRange(0, 100)
        self.progress_bar.setVisible(False)
        self.cancel_btn = QPushButton("Cancel")
        self.cancel_btn.setVisible(False)
        self.cancel_btn.clicked.connect(self.engine.cancel_load)
        self.url_label = QLabel()
        sb.addWidget(self.state_label)
        sb.addWidget(self.progress_bar)
        sb.addWidget(self.cancel_btn)
        sb.addPermanentWidget(self.url_label)

    def _about(self) -> None:
        QMessageBox.about(self, "About MoE Studio", "MoE Studio runs Mixture-of-Experts models bigger than your GPU.\n"
                          f"Data: {self.paths.data}\nConfig: {self.paths.config}\nLogs: {self.paths.log}")

    def bring_to_front(self) -> None:
        """Another launch asked for this window (app/single_instance.py). Wayland compositors may
        only flash it in the task bar instead of focusing it: they do not let a program take focus."""
        self.setWindowState(self.windowState() & ~Qt.WindowMinimized)  # keeps maximized/full screen
        self.show()
        self.raise_()
        self.activateWindow()

    def _new_chat(self) -> None:
        self.tabs.setCurrentWidget(self.chat)
        self.chat_ctl.new_conversation()

    # ---- engine ----------------------------------------------------------------------------------
    def _client(self):
        return self.engine.client(timeout=600.0) if self.engine.state == State.READY else None

    def start_engine(self) -> None:
        cfg = self.current_config()
        if cfg is None or not cfg.model:
            self.open_wizard()
            return
        if not Path(cfg.model).is_file():
            self.show_error("The model file is missing", f"{cfg.model} does not exist (moved or deleted?). "
                            "Choose a model in the setup wizard.")
            return
        try:
            host, port = check_address(self.settings.api_host, self.settings.api_port)
        except UserError as e:
            self.tabs.setCurrentWidget(self.api_panel)
            self.show_error("The API address is not valid", f"{e}. Fix it in the API tab.")
            return
        self.library.mark_used(cfg.model)
        self.models_panel.refresh()
        try:
            self.engine.start(LaunchSpec(cfg.model, preset_file(self.paths.presets, self.settings.current_preset),
                                         self.extra_args, api_key=cfg.api_key, host=host, port=port))
        except UserError as e:  # the host cannot be listened on (app/address.py says why)
            self.tabs.setCurrentWidget(self.api_panel)
            self.show_error("The engine cannot listen on the API address", f"{e}. Fix it in the API tab.")

    def restart_engine(self) -> None:
        if self.engine.spec is None:
            self.start_engine()
        else:
            self.engine.restart()

    def _apply_settings(self, cfg: Config) -> None:
        self._save_preset(self.settings.current_preset or "default", cfg)
        self.engine.spec = None
        self.engine.shutdown()
        self.start_engine()

    def _apply_address(self, host: str, port: int, key: str) -> None:
        """The API tab's Save: a checked address and key, kept, and the engine restarted on them."""
        try:
            host, port = check_address(host, port)
            key = save_api_key(self.paths.api_key_file, key)
        except UserError as e:
            self.api_panel.error.setText(str(e))
            return
        self.settings.api_host, self.settings.api_port = host, port
        self.settings.save(self.paths.settings_file)
        self.engine.stored_api_key = key
        self._show_address()
        if self.engine.state != State.STOPPED or self.engine.spec is not None:
            self.engine.spec = None
            self.engine.shutdown()
            self.start_engine()

    def _port_busy(self, host: str, port: int, suggestion: int) -> None:
        """Another program holds the API port: say so, and offer the next free one."""
        self.tabs.setCurrentWidget(self.api_panel)
        self.api_panel.error.setText(f"Port {port} on {host} is in use by another program."
                                     + (f" Port {suggestion} is free." if suggestion else ""))
        if self.port_dialog is not None:
            self.port_dialog.close()
        box = QMessageBox(QMessageBox.Warning, "The API port is in use",
                          f"Port {port} on {host} is in use by another program, so the engine was not started.",
                          QMessageBox.Cancel, self)
        if suggestion:
            box.setInformativeText(f"Use port {suggestion} instead? It is saved as the API address (API tab); "
                                   "tools configured against the old port need the new one.")
            box.use_button = use = box.addButton(f"Use port {suggestion}", QMessageBox.AcceptRole)
            box.buttonClicked.connect(lambda b: b is use and self._apply_address(host, suggestion,
                                                                                  self.engine.stored_api_key))
        else:
            box.setInformativeText("Stop the other program, or choose another port in the API tab.")
        self.port_dialog = box
        box.show()

    def _show_address(self) -> None:
        self.api_panel.set_address(self.settings.api_host, self.settings.api_port, self.engine.stored_api_key)

    def _state_changed(self, value: str) -> None:
        state = State(value)
        text = STATE_TEXT[state]
        if state == State.CRASHED and self.engine.last_crash:
            text += f": {self.engine.last_crash.summary}"
        self.state_label.setText(text)
        loading = state in (State.STARTING, State.LOADING)
        self.progress_bar.setVisible(loading)
        self.cancel_btn.setVisible(loading)
        self.act_cancel.setEnabled(loading)
        self.act_stop.setEnabled(state.running)
        self.act_start.setEnabled(not state.running and state != State.STOPPING)
        self.url_label.setText(self.engine.base_url or "" if state == State.READY else "")
        ready = state == State.READY
        self.api_panel.set_running(ready)
        msg = {State.STOPPED: "The engine is stopped: Engine > Start (or run the setup wizard).",
               State.STARTING: "Starting the engine\u2026", State.LOADING: "Loading the model\u2026",
               State.CRASHED: "The engine stopped unexpectedly; see the Logs tab.",
               State.STOPPING: "Stopping the engine\u2026"}.get(state, "")
        self.chat.set_engine_ready(ready, msg)
        if ready:
            self.dashboard.engine_changed()
            self.streamer.start(self.tasks, lambda: self.engine.client(timeout=10.0), lambda: self.engine.pid)
        else:
            self.streamer.stop()
            self.chat.set_context_size(None)
            self.settings_panel.set_effective(None)

    def _progress(self, pct: int, stage: str) -> None:
        self.progress_bar.setValue(pct)
        self.progress_bar.setFormat(f"{stage} %p%")
        if self.engine.state in (State.STARTING, State.LOADING):
            self.chat.set_engine_ready(False, f"Loading the model: {stage} ({pct}%)")

    def _ready(self, health: dict) -> None:
        self.chat.set_context_size(health.get("n_ctx"))
        self.statusBar().showMessage(f"{health.get('engine', '?')} engine: {health.get('engine_reason', '')}", 10000)
        self.dashboard.set_engine_reason(health.get("engine_reason"))
        self.settings_panel.set_effective(health)

    def _crashed(self, crash: Crash, will_restart: bool) -> None:
        if will_restart:
            self.statusBar().showMessage(f"{crash.title}: {crash.summary}. Restarting automatically "
                                         f"({self.engine.policy.restarts_in_row} of {self.engine.policy.max_restarts})\u2026",
                                         15000)
            return
        if self._closing:
            return
        if self.crash_dialog is not None:
            self.crash_dialog.close()
        dlg = CrashDialog(crash, self)
        dlg.accepted.connect(self.restart_engine)
        dlg.wizard_btn.clicked.connect(lambda: (dlg.close(), self.open_wizard()))
        self.crash_dialog = dlg
        dlg.show()

    # ---- wizard ----------------------------------------------------------------------------------
    def open_wizard(self) -> SetupWizard:
        if self.wizard is not None:
            self.wizard.raise_()
            return self.wizard
        if self.plan_service is None:
            self.plan_service = PlanService(self)
        self.wizard = SetupWizard(self.plan_service, self.settings.recent_models, self)
        self.wizard.finishedWith.connect(self._wizard_done)
        self.wizard.finished.connect(self._wizard_closed)
        self.wizard.show()
        return self.wizard

    def _wizard_done(self, name: str, cfg: Config, start: bool) -> None:
        try:
            self._save_preset(name, cfg)
        except (UserError, OSError) as e:
            self.show_error("Could not save the preset", str(e))
            return
        if start:
            self.engine.spec = None
            self.engine.shutdown()
            self.start_engine()

    def _wizard_closed(self, _result: int) -> None:
        if self.wizard is not None:
            self.wizard.deleteLater()
        self.wizard = None
        if self.plan_service is not None:
            self.plan_service.stop()

    # ---- errors -----------------------------------------------------------------------------------
    def show_error(self, title: str, message: str, details: str = "") -> ErrorDialog:
        log.error("%s: %s\n%s", title, message, details)
        dlg = ErrorDialog(title, message, details, self)
        dlg.show()
        return dlg

    # ---- quitting ----------------------------------------------------------------------------------
    def closeEvent(self, event) -> None:
        self._closing = True
        if self.chat_ctl.current:
            self.settings.last_conversation = self.chat_ctl.current.id
        try:
            self.settings.save(self.paths.settings_file)
        except OSError:
            pass
        self.chat_ctl.shutdown()
        self.streamer.stop()
        self.engine.shutdown()
        self.models_panel.stop()
        if self.plan_service is not None:
            self.plan_service.stop()
        self.tasks.wait(5.0)
        self.store.close()
        super().closeEvent(event)


# ---- application ---------------------------------------------------------------------------------
def _install_excepthook(app: QApplication) -> None:
    def hook(exc_type, exc, tb):
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        log.error("unexpected error: %s", text)
        if exc_type is KeyboardInterrupt:
            app.quit()
            return
        message = str(exc) if isinstance(exc, UserError) else f"{exc_type.__name__}: {exc}"
        parent = app.activeWindow()
        ErrorDialog("Something went wrong", message + "\n\nThe details are in app.log; please include them in a "
                    "bug report.", text, parent).show()
    sys.excepthook = hook


def has_display() -> bool:
    if not sys.platform.startswith("linux"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or os.environ.get("QT_QPA_PLATFORM"))


XCB_LIBS = {"xcb-cursor": "libxcb-cursor0", "xcb-icccm": "libxcb-icccm4", "xcb-keysyms": "libxcb-keysyms1",
            "xcb-image": "libxcb-image0", "xcb-render-util": "libxcb-render-util0", "xkbcommon-x11": "libxkbcommon-x11-0"}


def missing_x11_libraries(find=None) -> list[str]:
    """Debian package names of the X11 libraries Qt's xcb plugin needs and this system lacks.
    Without them Qt aborts with "could not load the Qt platform plugin xcb", which tells a
    person nothing; checked only when X11 (not Wayland, not a chosen platform) will be used, and
    not in the bundle, which carries its own copies (PyInstaller collects the xcb plugin's
    libraries) that the system's library search would not see."""
    if (not sys.platform.startswith("linux") or getattr(sys, "frozen", False)
            or os.environ.get("QT_QPA_PLATFORM") or os.environ.get("WAYLAND_DISPLAY")):
        return []
    if find is None:
        from ctypes.util import find_library as find
    return [pkg for lib, pkg in XCB_LIBS.items() if find(lib) is None]


def main(argv: list[str] | None = None) -> int:
    if not has_display():
        print("moestudio: no display found (DISPLAY/WAYLAND_DISPLAY unset), so the desktop app cannot open.\n"
              "  Terminal chat:  moestudio chat\n  HTTP server:    moestudio serve MODEL.gguf", file=sys.stderr)
        return 2
    missing = missing_x11_libraries()
    if missing:
        print("moestudio: the desktop app needs X11 libraries that are not installed: " + ", ".join(missing) +
              f"\n  Debian/Ubuntu: sudo apt install {' '.join(missing)}", file=sys.stderr)
        return 2
    # The window's WM_CLASS (X11) and app id (Wayland) come from these two; they must equal the
    # desktop entry's name (app/desktop_entry.py) for the shell to show the window under its icon.
    QGuiApplication.setApplicationName(APP_ID)
    QGuiApplication.setApplicationDisplayName("MoE Studio")
    QGuiApplication.setOrganizationName("moestudio")
    QGuiApplication.setDesktopFileName(APP_ID)
    app = QApplication.instance() or QApplication([sys.argv[0]] + list(argv or []))
    instance = SingleInstance()
    if instance.notify_running():
        print("moestudio: MoE Studio is already running; its window was brought to the front.", file=sys.stderr)
        return 0
    instance.listen()
    _install_excepthook(app)
    try:
        win = MainWindow()
    except Exception as e:  # e.g. a chat database from a newer version
        log.exception("could not open the main window")
        dlg = ErrorDialog("MoE Studio could not start", str(e), traceback.format_exc())
        dlg.exec()
        return 1
    # Test-only: tests/reliability/test_app_kill.py needs the real app, started as users start it, to
    # be streaming a reply into its database when it is SIGKILLed; this sends one message into the
    # current chat the first time the engine is ready. Unset (always, outside that test), it does nothing.
    if test_message := os.environ.get("MOESTUDIO_TEST_SEND"):
        win.engine.ready.connect(lambda _health: win.chat_ctl.send(test_message), Qt.SingleShotConnection)
    app.styleHints().colorSchemeChanged.connect(lambda _s: win.dashboard.apply_palette())
    instance.activated.connect(win.bring_to_front)
    win.show()
    if os.environ.get("MOESTUDIO_EXIT_AFTER_SHOW"):
        # Smoke start (tests/app/test_desktop.py launches the desktop entry's Exec line with it,
        # packaging/build_bundle.sh times the bundle's start by this line): quit as soon as the
        # window is up, the way File > Quit does.
        def exit_after_show() -> None:
            print("moestudio: main window shown; quitting (MOESTUDIO_EXIT_AFTER_SHOW)", file=sys.stderr, flush=True)
            win.close()
            app.quit()
        QTimer.singleShot(0, exit_after_show)
    return app.exec()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
