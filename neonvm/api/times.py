"""How times are written in Kubernetes objects (RFC 3339, UTC, ``Z``): the one place that
spells the format.

* ``metav1.MicroTime`` (a Lease's ``acquireTime`` / ``renewTime``, a VM's
  ``status.lastRestartTime``): microseconds, ``2026-01-02T03:04:05.123456Z``;
* ``metav1.Time`` (condition transition times): whole seconds, ``2026-01-02T03:04:05Z``.

A naive datetime is taken as UTC.
"""

from __future__ import annotations

import datetime as dt

MICROTIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def utc(at: dt.datetime) -> dt.datetime:
    return at.replace(tzinfo=dt.UTC) if at.tzinfo is None else at.astimezone(dt.UTC)


def format_microtime(at: dt.datetime) -> str:
    """``metav1.MicroTime``: ``2026-01-02T03:04:05.123456Z``."""
    return utc(at).strftime(MICROTIME_FORMAT)


def format_time(at: dt.datetime) -> str:
    """``metav1.Time``: ``2026-01-02T03:04:05Z`` (fractions dropped)."""
    return utc(at).strftime(TIME_FORMAT)


def parse(text: str | None) -> dt.datetime | None:
    """The instant an RFC 3339 ``text`` names (UTC), or None when it is missing or
    malformed (a bad value must never hold a VM back)."""
    if not text:
        return None
    try:
        return utc(dt.datetime.fromisoformat(text))
    except ValueError:
        return None
