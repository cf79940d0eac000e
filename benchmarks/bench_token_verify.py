"""TokenReviews per second from the API server, beside verifying the same tokens locally.

A new leader's first ask from each runner pod costs one TokenReview (its review cache is
new; docs/protocol.md, "A term's first grants are the tighter limit"). This measures how
many of those the API server answers per second from 1, 8, 16 and 32 client threads, as
the controller's identity, for tokens minted by the TokenRequest API bound to real pods
with the rights audience (fresh tokens for each round: the API server caches a token's
authentication for 10 s), and what :class:`~neonvm.controller.token_verify.TokenVerifier`
costs for the same tokens. Pods never start (no nodes): a bound token needs only the pod
object.

    python -m benchmarks.bench_token_verify --pods 1000 [--state-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

AUDIENCE = "vm.neon.tech/rights/bench/neonvm-controller"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--threads", default="1,8,16,32")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="a running cluster's state dir (default: a private one)")
    args = parser.parse_args()

    from benchmarks.__main__ import local_cluster, say
    from neonvm import kube
    from neonvm.controller.token_verify import TokenVerifier

    with local_cluster(args.state_dir, 0) as cluster:
        admin = kube.api_client(cluster.kubeconfig, pool_size=16)
        apiserver = int((cluster.state_dir / "run" / "kube-apiserver.pid").read_text())
        namespace = f"bench-jwks-{uuid.uuid4().hex[:5]}"
        kube.request(admin, "POST", "/api/v1/namespaces", body={"metadata": {"name": namespace}})
        kube.request(admin, "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts",
                     body={"metadata": {"name": "runner"}})

        def make_pod(i: int) -> tuple[str, str]:
            name = f"p-{i:05d}"
            made = kube.request(admin, "POST", f"/api/v1/namespaces/{namespace}/pods", body={
                "metadata": {"name": name},
                "spec": {"serviceAccountName": "runner", "automountServiceAccountToken": False,
                         "containers": [{"name": "runner", "image": "neonvm-runner:bench"}]}})
            return name, str(made["metadata"]["uid"])

        def mint(pod: tuple[str, str]) -> str:
            answer = kube.request(
                admin, "POST",
                f"/api/v1/namespaces/{namespace}/serviceaccounts/runner/token",
                body={"spec": {"audiences": [AUDIENCE], "expirationSeconds": 7200,
                               "boundObjectRef": {"apiVersion": "v1", "kind": "Pod",
                                                  "name": pod[0], "uid": pod[1]}}})
            return str(answer["status"]["token"])

        with ThreadPoolExecutor(8) as pool:
            pods = list(pool.map(make_pod, range(args.pods)))
        say(f"{len(pods)} pods in {namespace}")
        rows: list[str] = []
        all_tokens: list[str] = []
        for threads in [int(t) for t in args.threads.split(",")]:
            with ThreadPoolExecutor(8) as pool:
                tokens = list(pool.map(mint, pods))
            all_tokens += tokens
            controller = kube.api_client(cluster.kubeconfig_for("controller"),
                                         pool_size=threads)

            def review(token: str, api: Any = controller) -> float:
                start = time.monotonic()
                answer = kube.request(api, "POST", "/apis/authentication.k8s.io/v1/tokenreviews",
                                      body={"apiVersion": "authentication.k8s.io/v1",
                                            "kind": "TokenReview",
                                            "spec": {"token": token, "audiences": [AUDIENCE]}},
                                      timeout=30)
                if (answer.get("status") or {}).get("authenticated") is not True:
                    raise SystemExit(f"a review refused a fresh token: {answer.get('status')}")
                return time.monotonic() - start

            review(mint(pods[0]))  # the connection and the API server's caches warm
            cpu0, own0, t0 = cpu_seconds(apiserver), time.process_time(), time.monotonic()
            with ThreadPoolExecutor(threads) as pool:
                latencies = sorted(pool.map(review, tokens))
            elapsed, cpu = time.monotonic() - t0, cpu_seconds(apiserver) - cpu0
            own = time.process_time() - own0
            controller.close()
            rows.append(f"| TokenReview, {threads} threads | {len(tokens) / elapsed:,.0f}/s | "
                        f"{statistics.median(latencies) * 1e3:.1f} ms | "
                        f"{latencies[int(len(latencies) * 0.99) - 1] * 1e3:.1f} ms | "
                        f"{cpu / elapsed:.2f} cores | {own / len(tokens) * 1e6:,.0f} us |")
            say(rows[-1])
        verifier = TokenVerifier(admin, AUDIENCE)
        if not verifier.load():
            raise SystemExit("no service-account keys")
        for threads in (1, 8):
            own0, t0 = time.process_time(), time.monotonic()
            with ThreadPoolExecutor(threads) as pool:
                pods_of = list(pool.map(verifier.verify, all_tokens))
            elapsed, own = time.monotonic() - t0, time.process_time() - own0
            if any(p is None for p in pods_of):
                raise SystemExit("a fresh token was refused locally")
            rows.append(f"| local verify, {threads} threads | {len(all_tokens) / elapsed:,.0f}/s "
                        f"| | | 0 | {own / len(all_tokens) * 1e6:,.0f} us |")
            say(rows[-1])
        print(f"load average {os.getloadavg()[0]:.1f}; {len(pods)} pods; "
              f"Python {sys.version.split()[0]}")
        print("| what | rate | p50 | p99 | API server CPU | client CPU per token |\n"
              "|---|---:|---:|---:|---:|---:|")
        print("\n".join(rows))
        kube.request(admin, "DELETE", f"/api/v1/namespaces/{namespace}")
        admin.close()


if __name__ == "__main__":
    main()
