"""A lock contender, run by tests as its own process: increments a shared counter.

Each round it takes the VM lock (waiting for it), reads the counter key, and writes the
counter plus one by a *fenced* write (the transaction succeeds only while the lock key's
revision is still its token). Between read and write it yields the CPU, to widen the
window in which a second holder, if mutual exclusion were broken, would lose an update.

It waits for the key ``<prefix>/go`` before the first round, so that all contenders start
together. At the end it prints one JSON object: ``increments`` (fenced writes that
succeeded), ``lost`` (fenced writes refused) and ``tokens`` (the fencing tokens it held).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from neonvm.leader.etcd import Etcd, EtcdConfig, EtcdUnavailable
from neonvm.leader.lock import LockLost, LockManager
from neonvm.leader.session import Session


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--identity", required=True)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--epoch", type=int, default=1)
    args = p.parse_args()

    etcd = Etcd(EtcdConfig.from_env().with_overrides(endpoints=args.endpoint,
                                                       prefix=args.prefix))
    session = Session(etcd, ttl=10, name=args.identity)
    manager = LockManager(etcd, session, args.identity, args.prefix)
    counter = f"{args.prefix}/counter"
    print(json.dumps({"event": "ready"}), flush=True)
    while etcd.get(f"{args.prefix}/go") is None:
        time.sleep(0.02)

    increments, lost, tokens = 0, 0, []
    for _ in range(args.rounds):
        guard = manager.acquire("default", "contended", "uid-1", args.epoch, wait=60)
        tokens.append(guard.token)
        try:
            kv = etcd.get(counter)
            value = int(kv.value) if kv else 0
            time.sleep(0.002)
            guard.fenced_put(counter, str(value + 1).encode())
            increments += 1
        except LockLost:
            lost += 1
        except EtcdUnavailable as exc:
            print(json.dumps({"event": "error", "error": str(exc)}), flush=True)
            return 1
        finally:
            guard.release()
    session.close()
    etcd.close()
    print(json.dumps({"event": "done", "increments": increments, "lost": lost,
                      "tokens": tokens}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
