"""A lock holder, run by tests as its own process and then killed with SIGKILL.

Takes the named VM locks through one session and prints one JSON object with its lease
and tokens; then keeps the session alive until killed.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading

from neonvm.leader.etcd import Etcd, EtcdConfig
from neonvm.leader.lock import LockManager
from neonvm.leader.session import Session


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--identity", required=True)
    p.add_argument("--ttl", type=int, required=True)
    p.add_argument("--epoch", type=int, default=1)
    p.add_argument("vms", nargs="+", metavar="NAMESPACE/NAME")
    args = p.parse_args()

    etcd = Etcd(EtcdConfig.from_env().with_overrides(endpoints=args.endpoint,
                                                       prefix=args.prefix))
    session = Session(etcd, ttl=args.ttl, name=args.identity)
    manager = LockManager(etcd, session, args.identity, args.prefix)
    tokens = {}
    for ref in args.vms:
        namespace, name = ref.split("/")
        tokens[ref] = manager.acquire(namespace, name, f"uid-{name}", args.epoch).token
    print(json.dumps({"event": "holding", "lease": session.lease_id, "tokens": tokens}),
          flush=True)
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
