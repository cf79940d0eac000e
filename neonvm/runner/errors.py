"""Failures of the runner that the operator fixes, each said in one line.

Raised before QEMU starts (bad spec, missing file or tool) or when it cannot start.
``neonvm-runner`` prints ``error: <message>`` and exits 1; no traceback.
"""

from __future__ import annotations


class RunnerError(Exception):
    """An expected failure: the message is complete and fits on one line."""


class SpecError(RunnerError):
    """The VM spec cannot be run: it does not decode, or it contradicts itself."""


class HostError(RunnerError):
    """The host lacks something the spec needs: a binary, a file, KVM, a writable dir."""
