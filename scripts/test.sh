#!/usr/bin/env bash
# The test command. On a fresh machine it installs everything it needs first:
# a virtualenv with the package, the control-plane binaries (built once from the Go
# module proxy, cached in ~/.cache/neonvm), QEMU for the runner tests, and, where a real
# kubelet node can start, its host packages, binaries and the runner image (one
# real-node test runs by default; see docs/real-node.md).
#   bash scripts/test.sh            # lint, type-check, all tests
#   bash scripts/test.sh -m unit    # extra arguments go to pytest
#   NEONVM_TEST_REAL_NODE=0 bash scripts/test.sh   # no real node at all
source "$(dirname "$0")/lib/bootstrap.sh"
if [ -f scripts/setup-qemu.sh ]; then bash scripts/setup-qemu.sh; fi
bash scripts/setup-prometheus.sh
if [ "${NEONVM_TEST_REAL_NODE:-}" != "0" ]; then
  bash scripts/setup-realnode.sh
  neonvm dev install --real-nodes
else
  neonvm dev install
fi
echo "==> ruff" >&2
ruff check neonvm tests benchmarks
echo "==> mypy" >&2
mypy
echo "==> pytest" >&2
exec python -m pytest "$@"
