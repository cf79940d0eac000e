"""The small helpers several modules share: the one-line error summary and the RFC 3339
time formats."""

from __future__ import annotations

import datetime as dt

import pytest
from kubernetes.client.exceptions import ApiException

from neonvm.api import times
from neonvm.controller import decide
from neonvm.kube import short_error
from neonvm.leader import election

pytestmark = pytest.mark.unit


def test_short_error_of_an_api_error_is_status_and_reason() -> None:
    assert short_error(ApiException(status=409, reason="Conflict")) == "409 Conflict"


def test_short_error_keeps_the_first_line_and_at_most_300_characters() -> None:
    assert short_error(ValueError("first\nsecond")) == "ValueError: first"
    assert short_error(RuntimeError()) == "RuntimeError: "
    long = short_error(OSError("x" * 1000))
    assert len(long) == 300 and long.startswith("OSError: xxx")


def test_times_are_rfc3339_in_utc() -> None:
    aware = dt.datetime(2026, 1, 2, 4, 4, 5, 123456, tzinfo=dt.timezone(dt.timedelta(hours=1)))
    assert times.format_microtime(aware) == "2026-01-02T03:04:05.123456Z"
    assert times.format_time(aware) == "2026-01-02T03:04:05Z"
    naive = dt.datetime(2026, 1, 2, 3, 4, 5)
    assert times.format_microtime(naive) == "2026-01-02T03:04:05.000000Z"


def test_the_lease_and_the_vm_status_use_the_same_format() -> None:
    at = dt.datetime(2026, 5, 6, 7, 8, 9, 10, tzinfo=dt.UTC)
    assert election.format_microtime(at) == decide.format_rfc3339(at) \
        == "2026-05-06T07:08:09.000010Z"
    assert decide.parse_rfc3339(times.format_microtime(at)) == at
