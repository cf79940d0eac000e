"""Logging through loguru: readable lines on a terminal, or JSON lines for collectors."""

from __future__ import annotations

import json
import sys
from typing import Any

from loguru import logger


def _json_sink(message: Any) -> None:
    record = message.record
    line = {
        "ts": record["time"].isoformat(),
        "level": record["level"].name.lower(),
        "msg": record["message"],
        "logger": record["name"],
        **{k: _plain(v) for k, v in record["extra"].items()},
    }
    if record["exception"] is not None:
        line["exception"] = repr(record["exception"].value)
    sys.stderr.write(json.dumps(line) + "\n")
    sys.stderr.flush()


def _plain(value: Any) -> Any:
    return value if isinstance(value, str | int | float | bool | type(None)) else str(value)


def configure(level: str = "INFO", fmt: str = "text") -> None:
    """Route all neonvm logs to stderr in ``fmt`` ("text" or "json")."""
    logger.remove()
    if fmt == "json":
        logger.add(_json_sink, level=level.upper())
    else:
        logger.add(
            sys.stderr,
            level=level.upper(),
            format="<green>{time:HH:mm:ss.SSS}</green> <level>{level: <7}</level> "
            "<cyan>{name}</cyan> {message} <dim>{extra}</dim>",
            colorize=None,
        )
