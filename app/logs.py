"""Logging to rotating files under the platformdirs log dir: engine.log (the worker's output)
and app.log (the app's own messages and errors). No Qt."""
from __future__ import annotations

import logging
from logging.handlers import RotatingFileHandler
from pathlib import Path

ENGINE_LOG = "moestudio.engine"
APP_LOG = "moestudio.app"
_FMT = logging.Formatter("%(asctime)s %(levelname)s %(message)s")


def _file_handler(path: Path) -> RotatingFileHandler:
    h = RotatingFileHandler(path, maxBytes=2 * 1024 * 1024, backupCount=3, encoding="utf-8", delay=True)
    h.setFormatter(_FMT)
    h._moestudio = True  # type: ignore[attr-defined]
    return h


def setup_logging(log_dir: Path) -> dict[str, Path]:
    """(Re)points the engine and app loggers at files in log_dir; returns their paths."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, file in ((ENGINE_LOG, "engine.log"), (APP_LOG, "app.log")):
        logger = logging.getLogger(name)
        for h in list(logger.handlers):
            if getattr(h, "_moestudio", False):
                logger.removeHandler(h)
                h.close()
        logger.addHandler(_file_handler(log_dir / file))
        logger.setLevel(logging.INFO)
        logger.propagate = name == APP_LOG  # engine lines only go to their file and the panel
        paths[name] = log_dir / file
    return paths
