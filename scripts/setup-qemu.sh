#!/usr/bin/env bash
# Installs what the runner's QEMU tests need: QEMU, a distribution kernel to boot, and
# busybox + cpio to build a tiny initramfs guest. Idempotent and non-interactive; returns
# at once when everything is already installed. Installs as root (or with password-less
# sudo) through apt-get; elsewhere it explains what is missing and exits 0.
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

# Where nothing can be installed, say so and succeed: the test command goes on, and the
# QEMU tests skip with this message as their reason. A failing apt-get is an error.
if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup-qemu: cannot install ${missing[*]}: apt-get not found; install them by hand" >&2
    exit 0
fi
sudo=()
if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        sudo=(sudo -n)
    else
        echo "setup-qemu: cannot install ${missing[*]}: not root and no password-less sudo" >&2
        exit 0
    fi
fi

export DEBIAN_FRONTEND=noninteractive
# The tests boot the kernel with their own initramfs: skip building the distribution's
# initrd (slow, and not used). The kernel postinst hook honours INITRD=No.
export INITRD=No

echo "setup-qemu: installing ${missing[*]}" >&2
install() {
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive INITRD=No \
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}
# A fresh machine has empty package lists (apt-cache knows no candidate), and old lists
# may name versions the mirror no longer has: update first, or once after a failure.
updated=0
for p in "${missing[@]}"; do
    if ! apt-cache policy "$p" 2>/dev/null | grep -q 'Candidate: [0-9]'; then
        "${sudo[@]}" apt-get update -qq
        updated=1
        break
    fi
done
if ! install; then
    [[ $updated -eq 0 ]] || exit 1
    "${sudo[@]}" apt-get update -qq
    install
fi
echo "setup-qemu: done" >&2
