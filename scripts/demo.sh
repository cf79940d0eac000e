#!/usr/bin/env bash
# The main job: a local control plane (etcd, kube-apiserver, scheduler,
# controller-manager, simulated nodes), three controller replicas, a sample VM, and a
# live status view. Ctrl-C stops the view; `neonvm demo down` stops everything.
#   bash scripts/demo.sh                 # interactive, until Ctrl-C
#   bash scripts/demo.sh --duration 60   # non-interactive
source "$(dirname "$0")/lib/bootstrap.sh"
exec neonvm demo "$@"
