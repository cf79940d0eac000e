#!/usr/bin/env bash
# Installs what the runner's QEMU tests need: QEMU, a distribution kernel to boot, and
# busybox + cpio to build a tiny initramfs guest. Idempotent and non-interactive; returns
# at once when everything is already installed. Where nothing can be installed it says
# what is missing and exits 0: the QEMU tests then skip with that reason.
#
# Packages: qemu-system-x86 (the emulator), qemu-utils (qemu-img, for empty disks),
# linux-image-cloud-amd64 (a small kernel in /boot), busybox-static and cpio (the guest).
set -euo pipefail
exec bash "$(dirname "$0")/lib/apt-ensure.sh" setup-qemu \
    qemu-system-x86 qemu-utils linux-image-cloud-amd64 busybox-static cpio
