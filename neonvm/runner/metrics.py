"""Prometheus metrics for one runner, read from the state at scrape time.

A custom collector on a per-runner :class:`CollectorRegistry` (no global registry, so
several runners in one process, as in tests, do not mix their series). Values are taken
from one :class:`~neonvm.runner.state.Snapshot` per scrape, so they are consistent with
each other and never stale.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import get_args

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from neonvm.leader.health import add_process_collectors
from neonvm.runner.state import Phase, RunnerState


class RunnerCollector(Collector):
    """Exports the runner's state; see docs/runner.md for the series."""

    def __init__(self, state: RunnerState) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        s = self._state.snapshot()
        info = GaugeMetricFamily("neonvm_runner_info", "The VM this runner runs.",
                                 labels=["vm", "accel"])
        info.add_metric([s.vm, s.accel], 1)
        yield info
        yield GaugeMetricFamily(
            "neonvm_runner_acceleration_unavailable",
            "1 when the VM asked for KVM (enableAcceleration) and runs under TCG.",
            value=int(s.acceleration_unavailable is not None))
        phase = GaugeMetricFamily("neonvm_runner_phase", "1 for the current phase.",
                                  labels=["phase"])
        for name in get_args(Phase):
            phase.add_metric([name], 1 if s.phase == name else 0)
        yield phase
        yield GaugeMetricFamily("neonvm_runner_qemu_up", "1 while QEMU runs.",
                                value=int(s.qemu_alive))
        yield GaugeMetricFamily("neonvm_runner_guest_ready", "1 while /ready succeeds.",
                                value=int(s.ready))
        if s.uptime_seconds is not None:
            yield GaugeMetricFamily("neonvm_runner_qemu_uptime_seconds",
                                    "Seconds since QEMU started.", value=s.uptime_seconds)
        if s.boot_seconds is not None:
            yield GaugeMetricFamily("neonvm_runner_boot_seconds",
                                    "Seconds from QEMU start to the guest being ready.",
                                    value=s.boot_seconds)
        yield CounterMetricFamily("neonvm_runner_powerdown_requests",
                                  "ACPI power-down requests sent over QMP.",
                                  value=s.powerdown_requests)
        yield CounterMetricFamily("neonvm_runner_console_lines",
                                  "Lines the guest wrote to the serial console.",
                                  value=s.console_lines)
        yield GaugeMetricFamily("neonvm_runner_vcpus", "vCPUs plugged (changes live).",
                                value=s.vcpus)
        yield GaugeMetricFamily("neonvm_runner_max_vcpus", "vCPU limit.", value=s.max_vcpus)
        yield GaugeMetricFamily("neonvm_runner_memory_bytes",
                                "Guest memory plugged (changes live).",
                                value=s.memory_bytes)
        yield GaugeMetricFamily("neonvm_runner_max_memory_bytes", "Guest memory limit.",
                                value=s.max_memory_bytes)


def runner_registry(state: RunnerState) -> CollectorRegistry:
    """A fresh registry holding this runner's collector and the process, platform and
    GC collectors."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(RunnerCollector(state))
    return add_process_collectors(registry)
