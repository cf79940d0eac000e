"""JSON logs: an exception carries its traceback and an ``error`` field, and every line of
one reconcile carries the same ``reconcileID`` (:mod:`neonvm.logs`).

Pure (no servers): the handler runs over the fakes of ``test_handler``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from loguru import logger

from neonvm import logs
from neonvm.controller import actions as act
from neonvm.controller.reconciler import ReconcileResult
from tests.support.handler import World

pytestmark = pytest.mark.unit


@pytest.fixture
def json_logs(capsys: pytest.CaptureFixture[str]) -> Iterator[Any]:
    """``--log-format json`` at DEBUG; returns a reader of the lines written so far."""
    logs.configure("DEBUG", "json")

    def lines() -> list[dict[str, Any]]:
        return [json.loads(line) for line in capsys.readouterr().err.splitlines() if line]

    try:
        yield lines
    finally:
        logger.remove()
        logger.add(sys.stderr)


def _fails() -> None:
    raise ValueError("the disk is <full> & \"quoted\"")


def test_an_exception_carries_its_type_message_and_traceback(json_logs: Any) -> None:
    try:
        _fails()
    except ValueError:
        logger.exception("reconcile failed")
    (line,) = json_logs()
    assert line["msg"] == "reconcile failed" and line["level"] == "error"
    assert line["error"] == 'ValueError: the disk is <full> & "quoted"'
    assert line["errorType"] == "ValueError"
    trace = line["stacktrace"]
    assert trace.startswith("Traceback (most recent call last):")
    assert "in _fails" in trace and 'raise ValueError("the disk is' in trace
    assert "exception" not in line  # no repr(exc) any more


def test_a_chained_exception_shows_its_cause_and_a_library_type_its_module(
        json_logs: Any) -> None:
    from kubernetes.client.exceptions import ApiException

    try:
        try:
            _fails()
        except ValueError as exc:
            raise ApiException(status=409, reason="Conflict") from exc
    except ApiException:
        logger.opt(exception=True).warning("write refused")
    (line,) = json_logs()
    assert line["errorType"] == "kubernetes.client.exceptions.ApiException"
    assert line["error"].startswith("ApiException: (409)")
    assert "in _fails" in line["stacktrace"]
    assert "The above exception was the direct cause" in line["stacktrace"]


def _refuses(head: bytes) -> None:
    raise ValueError("bad request head", len(head))


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_traceback_shows_no_local_values_such_as_a_bearer_token(
        fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("DEBUG", fmt)
    token = "s3cret-" + "token-value"  # not in the source lines a traceback shows
    try:
        try:
            _refuses(f"POST /v1/rights\r\nAuthorization: Bearer {token}".encode())
        except ValueError:
            logger.exception("answering an ask failed")
        err = capsys.readouterr().err
    finally:
        logger.remove()
        logger.add(sys.stderr)
    assert "answering an ask failed" in err and "in _refuses" in err
    assert token not in err


def test_a_line_without_an_exception_has_no_error_fields(json_logs: Any) -> None:
    logger.bind(vm="ns/a").info("converged")
    (line,) = json_logs()
    assert line["vm"] == "ns/a" and not {"error", "errorType", "stacktrace"} & set(line)


class LoggingReconciler:
    """Logs two lines per reconcile, as the real one does through loguru, then ends
    stuck, so the handler itself logs a warning for the same turn."""

    def __init__(self) -> None:
        self.direct_first: list[bool] = []

    def reconcile(self, key: str, authority: Any, *,
                  direct_first: bool = False) -> ReconcileResult:
        logger.bind(vm=key).info("observed")
        logger.bind(vm=key).debug("acting")
        return ReconcileResult(action=act.Done(), requeue_after=1.0, steps=1,
                               stuck="the API keeps refusing")


def test_every_line_of_one_reconcile_has_one_id_and_the_next_reconcile_another(
        json_logs: Any) -> None:
    world = World()
    world.handler._reconciler = LoggingReconciler()
    world.turn()
    first = json_logs()
    world.turn(direct=True)
    second = json_logs()
    assert {line["msg"] for line in first} >= {"observed", "acting"}
    assert any(line["level"] == "warning" for line in first), first  # the handler's own
    ids_first = {line.get(logs.RECONCILE_ID) for line in first}
    ids_second = {line.get(logs.RECONCILE_ID) for line in second}
    assert len(ids_first) == 1 and len(ids_second) == 1
    assert None not in ids_first | ids_second
    assert ids_first != ids_second
    logger.info("between turns")
    assert logs.RECONCILE_ID not in json_logs()[0]
