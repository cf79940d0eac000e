"""The runner's HTTP server alone, run by tests as its own process under a low fd limit.

``python -m tests.programs.runner_http NOFILE`` lowers ``RLIMIT_NOFILE`` to NOFILE (as a
container's limit would be, only smaller), serves the runner's endpoints on a free port
of 127.0.0.1 with a fresh state (phase Preparing, so ``/healthz`` is 200), prints the
port on one line, and serves until killed.
"""

from __future__ import annotations

import resource
import sys
import threading

from neonvm.runner.metrics import runner_registry
from neonvm.runner.server import RunnerHTTPServer
from neonvm.runner.state import RunnerState, Sizing


def main() -> int:
    nofile = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    state = RunnerState(vm="default/probe", accel="tcg", ready_marker="",
                        sizing=Sizing(vcpus=1, max_vcpus=1, memory_bytes=1 << 30,
                                      max_memory_bytes=1 << 30))
    server = RunnerHTTPServer(state, runner_registry(state), "127.0.0.1", 0)
    server.start()
    print(server.port, flush=True)
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
