#!/usr/bin/env bash
# The test command. On a fresh machine it installs everything it needs first:
# a virtualenv with the package, the control-plane binaries (built once from the Go
# module proxy, cached in ~/.cache/neonvm), and QEMU for the runner tests.
#   bash scripts/test.sh            # lint, type-check, all tests
#   bash scripts/test.sh -m unit    # extra arguments go to pytest
source "$(dirname "$0")/lib/bootstrap.sh"
if [ -f scripts/setup-qemu.sh ]; then bash scripts/setup-qemu.sh; fi
neonvm dev install
echo "==> ruff" >&2
ruff check neonvm tests benchmarks
echo "==> mypy" >&2
mypy
echo "==> pytest" >&2
exec python -m pytest "$@"
