#!/usr/bin/env bash
# Installs what the runner's QEMU tests need: QEMU, a distribution kernel to boot, and
# busybox + cpio to build a tiny initramfs guest. Idempotent and non-interactive; returns
# at once when everything is already installed. Needs root (or sudo) on Debian/Ubuntu.
#
# Packages: qemu-system-x86 (the emulator), qemu-utils (qemu-img, for empty disks),
# linux-image-cloud-amd64 (a small kernel in /boot), busybox-static and cpio (the guest).
set -euo pipefail

packages=(qemu-system-x86 qemu-utils linux-image-cloud-amd64 busybox-static cpio)

missing=()
for p in "${packages[@]}"; do
    status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
    [[ "$status" == "install ok installed" ]] || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup-qemu: apt-get not found; install ${missing[*]} by hand" >&2
    exit 1
fi
sudo=()
if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1; then
        sudo=(sudo -n)
    else
        echo "setup-qemu: not root and no sudo; install ${missing[*]} by hand" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
# The tests boot the kernel with their own initramfs: skip building the distribution's
# initrd (slow, and not used). The kernel postinst hook honours INITRD=No.
export INITRD=No

echo "setup-qemu: installing ${missing[*]}" >&2
# A fresh machine has empty package lists: apt-cache then knows no candidate.
if ! apt-cache policy "${missing[0]}" 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    "${sudo[@]}" apt-get update -qq
fi
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive INITRD=No \
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup-qemu: done" >&2
