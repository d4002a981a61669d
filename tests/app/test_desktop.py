"""Desktop integration: the launcher entry validates and its Exec line starts the app; icons are
installed and removed; a second launch raises the running window, also after a crash left a
stale socket behind."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
from PySide6.QtGui import QImage

from app import desktop_entry
from app.desktop_entry import ICON_SIZES, desktop_entry as entry_text, exec_quote, install, uninstall
from app.main import MainWindow
from app.single_instance import SingleInstance, server_name

VALIDATOR = shutil.which("desktop-file-validate")
needs_validator = pytest.mark.skipif(
    VALIDATOR is None, reason="desktop-file-validate is not installed (Debian/Ubuntu: apt-get install desktop-file-utils)")


def exec_argv(entry: str) -> list[str]:
    """The argv a launcher runs for an entry's Exec line: the string-value unescaping first, then
    the spec's quoting rules (double quotes; inside them a backslash escapes the next character)."""
    line = next(v for k, _, v in (ln.partition("=") for ln in entry.splitlines()) if k == "Exec")
    line = re.sub(r"\\(.)", lambda m: {"s": " ", "n": "\n", "t": "\t", "r": "\r"}.get(m[1], m[1]), line)
    argv, cur, quoted, i, has_arg = [], "", False, 0, False
    while i < len(line):
        c = line[i]
        if quoted and c == "\\":
            cur, i = cur + line[i + 1], i + 2
            continue
        if c == '"':
            quoted, has_arg = not quoted, True
        elif c == " " and not quoted:
            if has_arg:
                argv.append(cur)
            cur, has_arg = "", False
        elif c == "%":  # only %% (a literal percent) occurs: the entry takes no field codes
            cur, has_arg, i = cur + "%", True, i + 1
        else:
            cur, has_arg = cur + c, True
        i += 1
    if has_arg:
        argv.append(cur)
    return argv


def isolated_env(tmp_path) -> dict[str, str]:
    """A home of its own: no user's presets, chats or running instance are seen or touched."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "MOESTUDIO_"))}
    for var, sub in (("HOME", "home"), ("XDG_CONFIG_HOME", "config"), ("XDG_DATA_HOME", "data"),
                     ("XDG_STATE_HOME", "state"), ("XDG_CACHE_HOME", "cache"), ("TMPDIR", "tmp")):
        env[var] = str(tmp_path / sub)
        (tmp_path / sub).mkdir(exist_ok=True)
    env["QT_QPA_PLATFORM"] = "offscreen"
    return env


@needs_validator
def test_entry_validates_and_install_uninstall_round_trip(tmp_path):
    written = install(tmp_path)
    entry = tmp_path / "applications" / "moestudio.desktop"
    assert entry in written
    result = subprocess.run([VALIDATOR, str(entry)], capture_output=True, text=True)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr
    text = entry.read_text()
    assert "Icon=moestudio\n" in text and "StartupWMClass=moestudio\n" in text
    # The Exec line is this venv's moestudio by absolute path: a launcher has no venv on PATH.
    assert exec_argv(text) == [os.path.join(os.path.dirname(sys.executable), "moestudio")]
    for n in ICON_SIZES:
        png = QImage(str(tmp_path / "icons" / "hicolor" / f"{n}x{n}" / "apps" / "moestudio.png"))
        assert (png.width(), png.height()) == (n, n)
        assert png.pixelColor(n // 2, n // 2).alpha() == 255  # drawn, not an empty canvas
    assert (tmp_path / "icons" / "hicolor" / "scalable" / "apps" / "moestudio.svg").is_file()

    removed = uninstall(tmp_path)
    assert sorted(removed) == sorted(written)
    assert not any(p.exists() for p in written)
    assert uninstall(tmp_path) == []


@needs_validator
def test_exec_quoting_survives_awkward_paths(tmp_path):
    argv = ["/opt/My Apps/moe$tudio \"x\"/bin/moestudio", "--flag=100%", "back\\slash"]
    entry = tmp_path / "odd.desktop"
    entry.write_text(entry_text(argv))
    result = subprocess.run([VALIDATOR, str(entry)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert exec_argv(entry.read_text()) == argv
    assert exec_quote("/plain/path") == "/plain/path"


def test_cli_installs_into_data_home(tmp_path, capsys):
    assert desktop_entry.main(["--data-home", str(tmp_path)]) == 0
    assert (tmp_path / "applications" / "moestudio.desktop").is_file()
    assert desktop_entry.main(["--data-home", str(tmp_path), "--uninstall"]) == 0
    assert not (tmp_path / "applications" / "moestudio.desktop").exists()
    assert f"removed {len(ICON_SIZES) + 2} file(s)" in capsys.readouterr().out  # PNGs, the SVG, the entry


@pytest.mark.slow
def test_exec_line_starts_the_app(tmp_path):
    """What a double-click runs: the entry's Exec line, as a launcher would split it, with
    nothing from this shell's venv; the app opens its window (the first-run wizard with it)."""
    env = isolated_env(tmp_path)
    install(tmp_path / "data")
    argv = exec_argv((tmp_path / "data" / "applications" / "moestudio.desktop").read_text())
    env["MOESTUDIO_EXIT_AFTER_SHOW"] = "1"
    env.pop("VIRTUAL_ENV", None)
    result = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "main window shown" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert (tmp_path / "config" / "moestudio").is_dir()  # it used the isolated home, not the user's


def test_stale_socket_of_a_crashed_instance_is_taken_over(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # Qt puts local sockets in $TMPDIR
    name = "moestudio-stale-test"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / name))
    stale.close()  # the socket file stays with nobody listening: what a crash leaves
    inst = SingleInstance(name)
    assert not inst.notify_running(300)
    assert inst.listen()
    try:
        with qtbot.waitSignal(inst.activated, timeout=3000):
            assert SingleInstance(name).notify_running()
    finally:
        inst.close()


@pytest.mark.slow
def test_second_launch_raises_the_running_window(qtbot, tmp_path, monkeypatch, app_paths):
    """The running app is this process (its window minimized); the second launch is a real
    `moestudio` process, which must find it, ask it to come forward and exit."""
    env = isolated_env(tmp_path)
    monkeypatch.setenv("TMPDIR", env["TMPDIR"])
    first = SingleInstance(server_name())
    assert first.listen()
    win = MainWindow(app_paths, autostart=False, show_wizard_if_needed=False)
    qtbot.addWidget(win)
    first.activated.connect(win.bring_to_front)
    win.showMinimized()
    qtbot.waitUntil(win.isMinimized, timeout=3000)
    second = None
    try:
        with qtbot.waitSignal(first.activated, timeout=60000):
            second = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moestudio")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, err = second.communicate(timeout=30)
        assert second.returncode == 0 and "already running" in err, err
        assert not win.isMinimized() and win.isVisible()
    finally:
        if second is not None and second.poll() is None:  # it opened a second app instead
            second.kill()
            second.wait()
        first.close()
