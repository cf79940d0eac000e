#!/usr/bin/env bash
# Installs Prometheus (Debian's package) for the metrics tests that run the dashboards'
# queries and the chart's alert rules through a real Prometheus (tests/test_metrics.py).
# Idempotent and non-interactive; where nothing can be installed it says so and exits 0:
# those tests then skip with that reason.
set -euo pipefail
exec bash "$(dirname "$0")/lib/apt-ensure.sh" setup-prometheus prometheus
