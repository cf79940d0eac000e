"""The entry point of the real node's services process (``python -m
neonvm.dev.nodeservices_main serve``): apart from :mod:`neonvm.dev.nodeservices` so that
module need not import the cluster and the node that start it (docs/real-node.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from neonvm.dev.cluster import LocalCluster
from neonvm.dev.nodeservices import serve
from neonvm.dev.realnode import RealNode


def main(argv: list[str] | None = None) -> int:
    """``python -m neonvm.dev.nodeservices_main serve --state-dir DIR --node N``."""
    parser = argparse.ArgumentParser(prog="python -m neonvm.dev.nodeservices_main")
    parser.add_argument("action", choices=("serve",))
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--node", type=int, default=0)
    args = parser.parse_args(argv)
    serve(RealNode(LocalCluster(args.state_dir), args.node))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
