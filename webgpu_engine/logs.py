"""Log levels by WebLLM's names (TRACE, DEBUG, INFO, WARN, ERROR, SILENT) and Python's (WARNING,
CRITICAL), applied to the package's logger. Standard library only (runs in the page)."""
from __future__ import annotations

import logging

TRACE = 5
SILENT = logging.CRITICAL + 10
LOG_LEVELS = {"TRACE": TRACE, "DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARN": logging.WARNING,
              "WARNING": logging.WARNING, "ERROR": logging.ERROR, "CRITICAL": logging.CRITICAL,
              "SILENT": SILENT}
logging.addLevelName(TRACE, "TRACE")
logging.addLevelName(SILENT, "SILENT")


def log_level(name) -> int:
    """The logging level for a level name (any case) or number; ValueError naming the choices."""
    if isinstance(name, int) and not isinstance(name, bool):
        return name
    lv = LOG_LEVELS.get(str(name).upper())
    if lv is None:
        raise ValueError(f"Unknown log level {name!r}; use one of {', '.join(LOG_LEVELS)}.")
    return lv


def set_log_level(name) -> None:
    """Set the level of the `webgpu_engine` logger (SILENT: nothing is logged)."""
    logging.getLogger("webgpu_engine").setLevel(log_level(name))
