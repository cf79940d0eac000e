"""A list or watch answer as the informer reads it from urllib3 (``.data`` for a page,
``.stream()`` for watch lines), for the informer's pure tests (tests/test_informer_bounds.py,
tests/test_too_large_vm.py)."""

from __future__ import annotations

import json
from typing import Any


def compact(obj: Any) -> str:
    """JSON as the API server writes it (no spaces)."""
    return json.dumps(obj, separators=(",", ":"))


class Answer:
    """A page (``body``) or a watch's event lines (``lines``)."""

    def __init__(self, body: dict[str, Any] | None = None,
                 lines: tuple[str, ...] | list[str] = ()) -> None:
        self.data = compact(body).encode() if body is not None else b""
        self.lines = lines

    def stream(self, *_: Any, **__: Any) -> Any:
        yield "\n".join(self.lines).encode() + b"\n"

    def release_conn(self) -> None:
        pass

    def close(self) -> None:
        pass


def modified(*objects: dict[str, Any]) -> Answer:
    """A watch answer: a MODIFIED event of each object, one JSON line each."""
    return Answer(lines=[compact({"type": "MODIFIED", "object": o}) for o in objects])
