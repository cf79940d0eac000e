"""``neonvm check``: judge any cluster against the invariant; exit 1 on a violation.

Exit codes: 0 the invariant holds, 1 it is violated, 2 usage, 3 the API server (or the
locks' etcd) cannot be reached, 4 it was reached but could not be read (no verdict).

What it checks, and why each judgement is sound, is in :mod:`neonvm.drills.check`:
at most one live runner pod per VM (strict and loose), ``status.podName`` names an
existing pod, no orphan pods, no orphan locks (when the locks' etcd is configured with
``NEONVM_ETCD_*`` or ``--etcd-endpoints``), nothing pending longer than
``--max-pending-seconds``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from neonvm.cli.exits import VIOLATION, verdict_errors
from neonvm.cli.kubeflags import cluster_client, kube_options
from neonvm.cli.output import OUTPUT_OPTION, emit
from neonvm.drills.check import check as run_check
from neonvm.drills.check import etcd_lock_reader


@click.command("check")
@kube_options
@click.option("-n", "--namespace", default=None,
              help="Only this namespace [default: all namespaces].")
@click.option("--max-pending-seconds", type=click.FloatRange(0), default=120.0,
              show_default=True,
              help="A plan, an unplanned VM or a deletion provably older than this is stuck.")
@click.option("--settle", type=click.FloatRange(0), default=0.0, show_default=True,
              help="Re-check after this many seconds; report only findings that persist "
                   "(duplicates are always reported).")
@click.option("--etcd-endpoints", metavar="URLS", default=None,
              help="Locks' etcd [env: NEONVM_ETCD_ENDPOINTS]; without it locks are skipped.")
@OUTPUT_OPTION
def check(kubeconfig: Path | None, context: str | None, request_timeout: float | None,
          namespace: str | None,
          max_pending_seconds: float, settle: float, etcd_endpoints: str | None,
          output: str) -> None:
    """Check the invariant now; exit 1 with details on any violation.

    Exit 3 if the cluster cannot be reached, 4 if it cannot be read (no verdict).
    """
    locks = etcd_lock_reader(etcd_endpoints)
    api = cluster_client(kubeconfig, context, request_timeout)
    try:
        with verdict_errors():
            report = run_check(api, namespace=namespace, locks=locks,
                               max_pending_seconds=max_pending_seconds, settle=settle)
    finally:
        api.close()
    if output != "table":
        emit(report.as_dict(), output)
    else:
        scope = f"namespace {namespace}" if namespace else "all namespaces"
        locks_text = "not checked" if report.locks is None else str(report.locks)
        click.echo(f"{scope}: {report.vms} VMs, {report.pods} runner pods, locks "
                   f"{locks_text}; {report.passes} pass(es)")
        if report.findings:
            emit([{"kind": f.kind, "vm": f.vm, "objects": ", ".join(f.objects),
                   "detail": f.detail} for f in report.findings], "table",
                 ["kind", "vm", "objects", "detail"])
        for note in report.notes:
            click.echo(f"note: {note}")
        click.echo("OK: the invariant holds" if report.ok else
                   f"VIOLATED: {len(report.findings)} finding(s)")
    if not report.ok:
        sys.exit(int(VIOLATION))
