"""The VM runner: the program inside a runner pod (``neonvm-runner``).

It runs exactly one QEMU for one VirtualMachine spec and ends when that QEMU ends. The
exit code tells the controller how the VM ended (0 only for a guest that powered itself
off). It never touches the Kubernetes API: everything it knows comes from its
environment, its flags and QEMU. See docs/runner.md.

Modules: :mod:`.qemu` (spec → command line, pure), :mod:`.disks` (disk files),
:mod:`.supervisor` (QEMU, QMP, SIGTERM), :mod:`.state` (readiness, exit codes),
:mod:`.server` and :mod:`.metrics` (HTTP), :mod:`.main` (the command).
"""
