"""The Go client of :mod:`benchmarks.bench_rights_failover`: build it, run it.

``benchmarks/rightsload`` is a stdlib-only Go program: one process, one goroutine per
simulated runner, each running a line-by-line port of the shipped
:class:`~neonvm.runner.right.RightKeeper`'s schedule and deadline rule over real HTTP
(tests/test_rightsload_parity.py runs the port and the keeper over the same scripted
answers). :func:`build_rightsload` compiles it once per source version into the cache
(``~/.cache/neonvm/bin``, outside the repository); :class:`GoClients` drives it with the
commands of the benchmark's Python client (:class:`~benchmarks.bench_rights_failover.Fleet`),
one JSON array a line on its stdin, its answers one JSON value a line on its stdout.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import IO, Any

SOURCE = Path(__file__).resolve().parent / "rightsload"
"""The Go module (go.mod, *.go)."""


def source_digest(source: Path = SOURCE) -> str:
    """12 hex of the SHA-256 over the module's file names and contents."""
    digest = hashlib.sha256()
    for path in sorted([source / "go.mod", *source.glob("*.go")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def binary_path(source: Path = SOURCE) -> Path:
    """Where the binary of this source version is (or will be) cached."""
    from neonvm.dev.binaries import cache_root

    return cache_root() / "bin" / f"rightsload-{source_digest(source)}"


def build_rightsload(source: Path = SOURCE) -> Path:
    """The binary of this source version: ``<cache>/bin/rightsload-<digest>``, built with
    ``go build`` if it is not there yet (a temporary file renamed into place, so two
    builders at once both end with a whole binary). Raises :class:`RuntimeError` if
    ``go`` is missing or the build fails."""
    go = shutil.which("go")
    if go is None:
        raise RuntimeError("the Go client needs the go toolchain on PATH (or use "
                           "--client python)")
    target = binary_path(source)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", dir=target.parent)
    os.close(fd)
    env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-buildvcs=false",
           "GOTOOLCHAIN": "local", "GOWORK": "off"}
    try:
        done = subprocess.run([go, "build", "-trimpath", "-o", tmp, "."], cwd=source,
                              env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"go build of {source} failed:\n{done.stderr}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return target


class GoClients:
    """All runners in one Go process: the interface of
    :class:`~benchmarks.bench_rights_failover.Clients` (send, ask_all, stats,
    granted_since, stop). Times sent and received are ``time.monotonic()`` seconds:
    the Go side reads the same clock (CLOCK_MONOTONIC)."""

    def __init__(self, specs: list[tuple[str, str, str, str, str]], seconds: float,
                 started: bool = False) -> None:
        binary = build_rightsload()
        self._dir = tempfile.TemporaryDirectory(prefix="rightsload-")
        spec = Path(self._dir.name) / "spec.json"
        spec.write_text(json.dumps([list(s) for s in specs]))
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(
            [str(binary), "-spec", str(spec), "-seconds", repr(float(seconds)),
             *(["-started"] if started else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def _pipes(self) -> tuple[IO[str], IO[str]]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        return self._proc.stdin, self._proc.stdout

    def send(self, *message: Any) -> None:
        stdin, _ = self._pipes()
        with self._lock:
            stdin.write(json.dumps(list(message)) + "\n")
            stdin.flush()

    def ask_all(self, *message: Any) -> list[Any]:
        """The one process's answer, in a list (as :class:`Clients` answers per process)."""
        stdin, stdout = self._pipes()
        with self._lock:
            stdin.write(json.dumps(list(message)) + "\n")
            stdin.flush()
            line = stdout.readline()
        if not line:
            raise RuntimeError(f"the Go client ended (exit {self._proc.poll()}) before "
                               f"answering {message[0]!r}")
        return [json.loads(line)]

    def stats(self) -> tuple[int, Counter[int], list[float], float, float]:
        """(asks, answers by status (0: none), latencies, the p99 lag of a 0.1 s timer,
        the process's CPU seconds) since the last call."""
        asks, codes, latencies, lag, cpu = self.ask_all("stats")[0]
        return (int(asks), Counter({int(c): int(n) for c, n in codes.items()}),
                [float(x) for x in latencies], float(lag), float(cpu))

    def granted_since(self, t: float) -> int:
        return int(self.ask_all("granted_since", t)[0])

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.send("stop")
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self._dir.cleanup()
