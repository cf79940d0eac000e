#!/usr/bin/env bash
# Every benchmark in one command; writes docs/benchmarks.md. Arguments go to
# `python -m benchmarks` (see --help): e.g. --large for 1,000 VMs.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m benchmarks "$@"
