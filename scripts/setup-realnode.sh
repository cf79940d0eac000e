#!/usr/bin/env bash
# Installs the host packages a real kubelet node and the image build need (see
# docs/real-node.md and docs/images.md); the Go-built binaries come from
# `neonvm dev install --real-nodes`. Idempotent and non-interactive, like setup-qemu.sh.
#
# Packages: mmdebstrap (the images' Debian root filesystems), iptables (the CNI bridge
# and portmap plugins' NAT rules), libseccomp-dev, gcc and pkg-config (runc is built with
# its seccomp tag, which links libseccomp through cgo), e2fsprogs (ext4 guest disks).
set -euo pipefail
exec bash "$(dirname "$0")/lib/apt-ensure.sh" setup-realnode \
    mmdebstrap iptables libseccomp-dev gcc pkg-config e2fsprogs
