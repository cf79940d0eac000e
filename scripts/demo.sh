#!/usr/bin/env bash
# The main job: a local control plane (etcd, kube-apiserver, scheduler,
# controller-manager, simulated nodes), where the host allows a real kubelet node on
# which the VM's runner pod boots its guest under QEMU (otherwise one line says why and
# the simulated nodes are used), three controller replicas, a VM, and a live status
# view. Ctrl-C stops the view; `neonvm demo down` stops everything.
#   bash scripts/demo.sh                  # interactive, until Ctrl-C
#   bash scripts/demo.sh --duration 60    # non-interactive
#   bash scripts/demo.sh --no-real-node   # simulated nodes only (the quickest)
# The first run with a real node builds its binaries and the runner image (cached in
# ~/.cache/neonvm; see docs/real-node.md for the times).
# The demo needs no test tools (pytest, mypy, ruff): a first run skips fetching them.
NEONVM_EXTRAS="${NEONVM_EXTRAS-}" source "$(dirname "$0")/lib/bootstrap.sh"
case " $* " in
  *" --no-real-node "*) ;;
  *) bash scripts/setup-qemu.sh; bash scripts/setup-realnode.sh ;;
esac
exec neonvm demo "$@"
