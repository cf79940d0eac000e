"""Two controller installations on one locks etcd and one key prefix, side by side.

    python -m benchmarks.side_by_side                  # 5 minutes, a private control plane
    python -m benchmarks.side_by_side --duration 60    # a shorter run
    python -m benchmarks.side_by_side --state-dir D    # a running cluster (neonvm dev up)

Each installation watches its own namespace (``--watch-namespace``) and campaigns for its
own Lease there; both use the same ``--etcd-prefix``. Prints, per installation, the locks
the other installation removed (must be 0), the locks of live VMs deleted by anyone (must
be 0), how many of its VMs converged, and its epoch. Exits 1 unless all of that holds.
See ``tests/support/installations.py`` for what is measured and how. Opt-in: no test
command runs it (the real-server test ``tests/test_locks.py`` runs a short version).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from benchmarks.__main__ import local_cluster, say


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=300.0,
                        help="Seconds side by side (default 300).")
    parser.add_argument("--vms", type=int, default=4, help="VMs per installation at start.")
    parser.add_argument("--replicas", type=int, default=1, help="Replicas per installation.")
    parser.add_argument("--churn-every", type=float, default=20.0,
                        help="Seconds between creating one VM and deleting one, per side.")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="Use this running local cluster instead of a private one.")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="Where the replicas' logs go (default: a temporary directory).")
    args = parser.parse_args()

    from neonvm import kube
    from tests.support.installations import run_side_by_side

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="neonvm-side-by-side-"))
    with local_cluster(args.state_dir, nodes=2) as cluster:
        api = kube.api_client(cluster.kubeconfig)
        try:
            report = run_side_by_side(
                api, cluster.kubeconfig_for("controller"), cluster.locks_etcd_config, log_dir,
                duration=args.duration, vms=args.vms, churn_every=args.churn_every,
                replicas_each=args.replicas, progress=say)
        finally:
            api.close()
    print(report.text())
    print(f"replica logs: {log_dir}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
