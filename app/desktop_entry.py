"""`moestudio install-desktop [--uninstall]`: MoE Studio in the desktop's launcher, for this user.

Writes a freedesktop `.desktop` entry to $XDG_DATA_HOME/applications and the icon to
$XDG_DATA_HOME/icons/hicolor (the SVG as "scalable" plus PNGs rendered from it), so the app
appears in the launcher and opens with a double-click. The entry's name, `moestudio`, is the
desktop file name the app gives Qt (app/main.py), which is how Wayland and X11 shells match
its window to this entry and its icon.

PNGs are rendered from resources/moestudio.svg here, at install time, with QtSvg (no
QApplication needed): the SVG stays the one source of the icon, no binary copies of it live in
git, and each size is drawn sharp from the vector. Torch-free and Qt-GUI-free, so it also runs
as `python -m app.desktop_entry` (packaging/install-desktop.sh) without the engine's imports.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from engine.errors import UserError

APP_ID = "moestudio"  # the .desktop file's and icon's name; = QGuiApplication.desktopFileName
ICON_SVG = Path(__file__).resolve().parent.parent / "resources" / "moestudio.svg"
# hicolor sizes launchers, docks, alt-tab and the window list ask for (48 is the spec's required one).
ICON_SIZES = (16, 22, 24, 32, 48, 64, 128, 256, 512)
DESCRIPTION = ("Adds MoE Studio to the desktop's application launcher for the current user: a freedesktop "
               ".desktop entry that starts this installation, and its icons. --uninstall removes them.")
# Characters after which an Exec argument must be quoted (Desktop Entry spec, "The Exec key").
_EXEC_RESERVED = frozenset(" \t\n\"'\\><~|&;$*?#`()")


def data_home() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")


def launch_command() -> list[str]:
    """The command that starts this installation of MoE Studio, with absolute paths: a launcher
    does not run in the venv and has no PATH to it."""
    if getattr(sys, "frozen", False):  # the PyInstaller bundle: its executable is the app
        return [sys.executable]
    # The venv's console script sits beside its python (not resolved: the venv's bin/python is a
    # symlink to the base interpreter, whose folder has no moestudio).
    script = Path(sys.executable).with_name("moestudio")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "engine.cli"]


def exec_quote(arg: str) -> str:
    """One Exec argument as the spec wants it: quoted if it has a reserved character, with `"`,
    backquote, `$` and backslash escaped inside the quotes, `%` doubled (else it would be a field
    code), and then the string-value escaping of backslashes that applies to every key."""
    arg = arg.replace("%", "%%")
    if any(c in _EXEC_RESERVED for c in arg):
        arg = '"' + re.sub(r'(["`$\\])', r"\\\1", arg) + '"'
    return arg.replace("\\", "\\\\")


def desktop_entry(command: list[str]) -> str:
    return "\n".join([
        "[Desktop Entry]",
        "Type=Application",
        "Version=1.4",  # 1.5 is not known to Debian 12's desktop-file-validate (0.26)
        "Name=MoE Studio",
        "GenericName=Local LLM runner",
        "Comment=Run Mixture-of-Experts language models bigger than your GPU",
        "Exec=" + " ".join(exec_quote(a) for a in command),
        # The launcher hides the entry once the venv or bundle it points to is gone.
        "TryExec=" + command[0].replace("\\", "\\\\"),
        f"Icon={APP_ID}",
        "Terminal=false",
        "Categories=Science;ArtificialIntelligence;",
        "Keywords=LLM;GGUF;MoE;AI;chat;llama.cpp;",
        "StartupNotify=true",
        # X11 shells match windows to entries by WM_CLASS, whose class Qt takes from the
        # application name, which app/main.py sets to this.
        f"StartupWMClass={APP_ID}",
        "",
    ])


def _icon_files(root: Path) -> list[Path]:
    hicolor = root / "icons" / "hicolor"
    return ([hicolor / f"{n}x{n}" / "apps" / f"{APP_ID}.png" for n in ICON_SIZES]
            + [hicolor / "scalable" / "apps" / f"{APP_ID}.svg"])


def _entry_file(root: Path) -> Path:
    return root / "applications" / f"{APP_ID}.desktop"


def render_png(svg: Path, size: int, out: Path) -> None:
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise UserError(f"the icon {svg} is not a valid SVG")
    image = QImage(size, size, QImage.Format_ARGB32_Premultiplied)
    image.fill(Qt.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.Antialiasing)
    renderer.render(painter)
    painter.end()
    out.parent.mkdir(parents=True, exist_ok=True)
    if not image.save(str(out), "PNG"):
        raise UserError(f"could not write {out}")


def _refresh_caches(root: Path) -> None:
    """Best effort: launchers also watch these folders, so a missing tool is not an error. An icon
    cache is only refreshed where one exists: GTK trusts an existing cache over the folder, so a
    stale one would hide the icon, while creating one where there was none would go stale the
    next time anything else installs an icon there."""
    apps = root / "applications"
    hicolor = root / "icons" / "hicolor"
    commands = [["update-desktop-database", "-q", str(apps)]]
    if (hicolor / "icon-theme.cache").exists():
        commands.append(["gtk-update-icon-cache", "-q", "-f", "-t", str(hicolor)])
    for cmd in commands:
        if shutil.which(cmd[0]) and Path(cmd[-1]).is_dir():
            subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def install(root: Path | None = None, command: list[str] | None = None) -> list[Path]:
    """Writes the entry and icons below `root` (default $XDG_DATA_HOME); returns what it wrote."""
    if not sys.platform.startswith("linux"):
        raise UserError("install-desktop is for Linux (freedesktop) desktops; for Windows see packaging/README.md")
    if not ICON_SVG.is_file():
        raise UserError(f"the icon {ICON_SVG} is missing from this installation")
    root = root or data_home()
    written = []
    for path in _icon_files(root):
        if path.suffix == ".svg":
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ICON_SVG, path)
        else:
            render_png(ICON_SVG, int(path.parent.parent.name.split("x")[0]), path)
        written.append(path)
    entry = _entry_file(root)
    entry.parent.mkdir(parents=True, exist_ok=True)
    entry.write_text(desktop_entry(command or launch_command()), encoding="utf-8")
    written.append(entry)
    _refresh_caches(root)
    return written


def uninstall(root: Path | None = None) -> list[Path]:
    """Removes what `install` writes below `root`; returns what was there."""
    root = root or data_home()
    removed = []
    for path in [_entry_file(root), *_icon_files(root)]:
        if path.exists():
            path.unlink()
            removed.append(path)
    _refresh_caches(root)
    return removed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--uninstall", action="store_true", help="remove the launcher entry and icons instead")
    p.add_argument("--data-home", type=Path, default=None, metavar="DIR",
                   help="install below DIR instead of $XDG_DATA_HOME (default ~/.local/share)")


def run(args: argparse.Namespace) -> int:
    if args.uninstall:
        removed = uninstall(args.data_home)
        print(f"removed {len(removed)} file(s)" + "".join(f"\n  {p}" for p in removed)
              if removed else "MoE Studio was not installed in the launcher; nothing to remove")
        return 0
    written = install(args.data_home)
    print(f"MoE Studio is in the launcher now (runs: {' '.join(launch_command())})\n  {written[-1]}\n"
          f"  icons in {written[0].parents[2]}\nRemove with: moestudio install-desktop --uninstall")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("install-desktop", help="add MoE Studio to the desktop's application launcher (this user)",
                       description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(run=run)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="install-desktop", description=DESCRIPTION)
    add_arguments(p)
    try:
        return run(p.parse_args(argv))
    except UserError as e:
        print(f"install-desktop: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
