"""Logging through loguru: readable lines on a terminal, or JSON lines for collectors.

A JSON line carries ``ts``, ``level``, ``msg``, ``logger`` and the bound fields; a line
logged with an exception also carries ``error`` (``"Type: message"``, the field
controller-runtime's zap logger writes), ``errorType`` and ``stacktrace`` (the formatted
traceback). Every line logged inside one reconcile carries the same ``reconcileID`` (as
controller-runtime's), set by :func:`per_reconcile`. See docs/cli.md, "Logs".
"""

from __future__ import annotations

import functools
import json
import sys
import traceback
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from loguru import logger

RECONCILE_ID = "reconcileID"
"""The field that names one reconcile on each of its lines."""

F = TypeVar("F", bound=Callable[..., Any])


def per_reconcile(f: F) -> F:
    """Run ``f`` with a fresh ``reconcileID`` bound to every line it logs (loguru's
    ``contextualize``: per thread and per task, so concurrent workers do not mix)."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with logger.contextualize(**{RECONCILE_ID: str(uuid.uuid4())}):
            return f(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def error_fields(exc: BaseException) -> dict[str, str]:
    """``error``, ``errorType`` and ``stacktrace`` for ``exc`` (chained causes included)."""
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else \
        f"{kind.__module__}.{kind.__qualname__}"
    message = str(exc)
    return {
        "error": f"{kind.__qualname__}: {message}" if message else kind.__qualname__,
        "errorType": name,
        "stacktrace": "".join(traceback.format_exception(exc)).rstrip("\n"),
    }


def json_line(record: Any) -> str:
    """One loguru record as the JSON line the ``json`` format writes."""
    line = {
        "ts": record["time"].isoformat(),
        "level": record["level"].name.lower(),
        "msg": record["message"],
        "logger": record["name"],
        **{k: _plain(v) for k, v in record["extra"].items()},
    }
    exception = record["exception"]
    if exception is not None and exception.value is not None:
        line.update(error_fields(exception.value))
    return json.dumps(line)


def _json_sink(message: Any) -> None:
    sys.stderr.write(json_line(message.record) + "\n")
    sys.stderr.flush()


def _plain(value: Any) -> Any:
    if isinstance(value, BaseException):
        return f"{type(value).__qualname__}: {value}"
    return value if isinstance(value, str | int | float | bool | type(None)) else str(value)


def configure(level: str = "INFO", fmt: str = "text") -> None:
    """Route all neonvm logs to stderr in ``fmt`` ("text" or "json")."""
    logger.remove()
    if fmt == "json":
        logger.add(_json_sink, level=level.upper(), diagnose=False)
    else:
        logger.add(
            sys.stderr,
            level=level.upper(),
            format="<green>{time:HH:mm:ss.SSS}</green> <level>{level: <7}</level> "
            "<cyan>{name}</cyan> {message} <dim>{extra}</dim>",
            colorize=None,
            diagnose=False,  # a traceback shows no local values: bearer tokens, request heads
        )
