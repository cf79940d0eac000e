"""A small asyncio client for QEMU's QMP protocol over a unix socket.

QMP is line-delimited JSON: a greeting, ``qmp_capabilities`` to leave negotiation mode,
then commands (answered by ``return`` or ``error`` carrying our ``id``) interleaved with
asynchronous ``event`` messages. One reader task owns the socket: it resolves pending
commands by id and hands every event to ``on_event`` in arrival order.

Guaranteed: every event QEMU wrote before closing the socket reaches ``on_event`` before
:attr:`QMPClient.closed` is set, so a caller that waits for ``closed`` after QEMU exits
has seen its final ``SHUTDOWN`` event. Commands still pending when the socket closes fail
with :class:`QMPError`. Not guaranteed: reconnection (QEMU's socket accepts one client;
the runner connects once for QEMU's lifetime).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

QMPEvent = dict[str, Any]


class QMPError(Exception):
    """A command failed, or the connection is gone."""


class QMPCommandError(QMPError):
    """QEMU answered the command with an error: it was not carried out. (A plain
    :class:`QMPError` may also mean no answer came, and then nobody knows.)"""


class QMPClient:
    """One QMP session; create with :meth:`connect`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 on_event: Callable[[QMPEvent], None]) -> None:
        self._reader = reader
        self._writer = writer
        self._on_event = on_event
        self._ids = itertools.count(1)
        self._pending: dict[str, asyncio.Future[Any]] = {}
        self.closed = asyncio.Event()
        self.greeting: dict[str, Any] = {}
        self._reader_task: asyncio.Task[None] | None = None

    @classmethod
    async def connect(cls, path: Path, on_event: Callable[[QMPEvent], None]) -> QMPClient:
        """Connect, read the greeting and negotiate capabilities (raises OSError, QMPError)."""
        reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 20)
        client = cls(reader, writer, on_event)
        try:
            line = await reader.readline()
            if not line:
                raise QMPError("QMP socket closed before the greeting")
            try:
                client.greeting = json.loads(line)
            except json.JSONDecodeError:
                raise QMPError(f"not a QMP greeting: {line[:80]!r}") from None
            client._reader_task = asyncio.create_task(client._read_loop(), name="qmp-reader")
            await client.execute("qmp_capabilities")
        except BaseException:
            # QEMU serves one QMP client at a time: a half-open session would block the
            # next attempt, so close it before giving up.
            await client.close()
            raise
        return client

    async def execute(self, command: str, arguments: dict[str, Any] | None = None,
                      timeout: float = 10.0) -> Any:
        """Run ``command`` and return its ``return`` value; raise QMPError on error."""
        if self.closed.is_set():
            raise QMPError(f"{command}: QMP connection closed")
        request_id = f"runner-{next(self._ids)}"
        message: dict[str, Any] = {"execute": command, "id": request_id}
        if arguments:
            message["arguments"] = arguments
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            self._writer.write(json.dumps(message).encode() + b"\n")
            await self._writer.drain()
            return await asyncio.wait_for(future, timeout)
        except (ConnectionError, OSError) as exc:
            raise QMPError(f"{command}: {exc}") from None
        except TimeoutError:
            raise QMPError(f"{command}: no answer within {timeout:g}s") from None
        finally:
            self._pending.pop(request_id, None)

    async def _read_loop(self) -> None:
        try:
            while True:
                line = await self._reader.readline()
                if not line:
                    break
                try:
                    message = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "event" in message:
                    self._on_event(message)
                    continue
                future = self._pending.get(str(message.get("id")))
                if future is None or future.done():
                    continue
                if "error" in message:
                    err = message["error"]
                    future.set_exception(QMPCommandError(f"{err.get('class')}: {err.get('desc')}"))
                else:
                    future.set_result(message.get("return"))
        except (ConnectionError, OSError):
            pass
        finally:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(QMPError("QMP connection closed"))
            self.closed.set()

    async def close(self) -> None:
        """Close the socket and wait for the reader to finish."""
        self._writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self._writer.wait_closed()
        if self._reader_task is not None:
            await self._reader_task
