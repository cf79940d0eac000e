"""``neonvm leader``: who leads, since when, under which epoch; ask the leader to step down.

``step-down`` is addressed, never blind: it reads the Lease, then writes the annotation
``leader.vm.neon.tech/step-down = {"holder": H, "epoch": E}`` with a ``resourceVersion``
precondition on the version it read. If leadership moved in between, the write fails
and is not retried against the new leader. The holder acts only on a request naming its
own identity and epoch: it stops its leader work, then releases the Lease; a standby takes
it within about one retry period. A request naming an earlier holder or term is ignored
(the next acquisition removes it).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from neonvm.cli.kubeflags import cluster_client, kube_options
from neonvm.cli.output import emit, object_name, output_option
from neonvm.leader.election import (
    DEFAULT_LEASE_NAME,
    DEFAULT_NAMESPACE,
    LeaseClient,
    LeaseRecord,
    StepDownRequest,
    format_microtime,
    parse_microtime,
)

REQUEST_TIMEOUT = 10.0

_NAMESPACE = click.option("-n", "--namespace", default=DEFAULT_NAMESPACE, show_default=True,
                          help="Namespace of the Lease.")
_NAME = click.option("--name", "lease_name", default=DEFAULT_LEASE_NAME, show_default=True,
                     help="Name of the Lease.")


@click.group()
def leader() -> None:
    """Inspect and steer the controller's leader election (a coordination.k8s.io Lease)."""


def _client(kubeconfig: Path | None, context: str | None,
            request_timeout: float | None) -> client.ApiClient:
    return cluster_client(kubeconfig, context, request_timeout)


def _read(leases: LeaseClient) -> LeaseRecord:
    record = leases.get(REQUEST_TIMEOUT)
    if record is None:
        raise click.ClickException(
            f"no Lease {leases.namespace}/{leases.name}: no replica has campaigned yet")
    return record


def describe(record: LeaseRecord, now: datetime | None = None) -> dict[str, Any]:
    """What ``show`` prints. ``expiresIn`` compares the holder's renewTime with this
    machine's wall clock, so it is an estimate (clock skew); replicas never decide with it."""
    now = now or datetime.now(UTC)
    renewed = parse_microtime(record.renew_time)
    duration = record.lease_duration_seconds
    expires_in: float | None = None
    if renewed is not None and duration is not None and record.holder:
        expires_in = round((renewed - now).total_seconds() + duration, 1)
    if not record.holder:
        state = "released"
    elif expires_in is not None and expires_in <= 0:
        state = "expired"
    else:
        state = "held"
    if record.step_down is not None and record.step_down.names(record.holder, record.transitions):
        state += ", step-down requested"
    meta = record.raw.get("metadata") or {}
    return {
        "lease": f"{meta.get('namespace', '')}/{meta.get('name', '')}",
        "holder": record.holder or None,
        "epoch": record.transitions,
        "state": state,
        "acquired": record.acquire_time,
        "renewed": record.renew_time,
        "leaseDurationSeconds": duration,
        "expiresIn": expires_in,
        "leaseTransitions": record.transitions,
    }


@leader.command()
@_NAMESPACE
@_NAME
@kube_options
@output_option("name")
def show(namespace: str, lease_name: str, kubeconfig: Path | None, context: str | None,
         request_timeout: float | None, output: str) -> None:
    """Show the current holder, its epoch, and when its Lease expires.

    ``-o name`` prints ``lease.coordination.k8s.io/<name>`` (as kubectl) if the Lease exists.
    """
    with _client(kubeconfig, context, request_timeout) as api:
        record = _read(LeaseClient(api, namespace, lease_name))
    if output == "name":
        click.echo(object_name("Lease", "coordination.k8s.io", lease_name))
        return
    emit(describe(record), output,
         columns=["lease", "holder", "epoch", "state", "acquired", "renewed", "expiresIn",
                  "leaseTransitions"])


@leader.command("step-down")
@_NAMESPACE
@_NAME
@kube_options
@click.option("--holder", default=None,
              help="Only if this identity holds the Lease (refuse otherwise).")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until the holder has released and report who leads next.")
@click.option("--timeout", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Seconds to wait with --wait.")
def step_down(namespace: str, lease_name: str, kubeconfig: Path | None, context: str | None,
              request_timeout: float | None, holder: str | None, wait: bool,
              timeout: float) -> None:
    """Ask the current leader to stop its work and release the Lease.

    The request names the holder and epoch read just before, and is written only if the
    Lease has not changed since: it can never depose a leader elected after the read.
    """
    with _client(kubeconfig, context, request_timeout) as api:
        leases = LeaseClient(api, namespace, lease_name)
        record = _read(leases)
        if not record.holder:
            raise click.ClickException("the Lease is released: there is no leader to step down")
        if holder is not None and record.holder != holder:
            raise click.ClickException(
                f"the Lease is held by {record.holder}, not {holder}: nothing requested")
        request = StepDownRequest(record.holder, record.transitions,
                                  format_microtime(datetime.now(UTC)))
        _request_step_down(leases, record, request)
        click.echo(f"asked {record.holder} (epoch {record.transitions}) to step down")
        if not wait:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fresh = leases.get(REQUEST_TIMEOUT)
            if fresh is None or fresh.transitions != record.transitions or \
                    fresh.holder != record.holder:
                if fresh is not None and fresh.holder and fresh.holder != record.holder:
                    click.echo(f"{fresh.holder} leads now (epoch {fresh.transitions})")
                    return
                if fresh is not None and fresh.holder == record.holder:
                    click.echo(f"{record.holder} stepped down and leads again "
                               f"(epoch {fresh.transitions}): no other candidate took over")
                    return
            time.sleep(0.2)
        raise click.ClickException(
            f"{record.holder} has not handed over within {timeout:g}s "
            "(is it running, and does it support step-down?)")


def _request_step_down(leases: LeaseClient, record: LeaseRecord,
                       request: StepDownRequest) -> None:
    """Write ``request`` by CAS. A conflict from a renewal of the same term (same holder,
    same epoch) is retried on the fresh version: the request names that term, so the
    intent is unchanged. Any other change means the term is over: never re-target."""
    current = record
    for _ in range(10):
        try:
            leases.replace(current, {}, REQUEST_TIMEOUT, step_down=request)
            return
        except ApiException as exc:
            if exc.status != 409:
                raise
        fresh = leases.get(REQUEST_TIMEOUT)
        if fresh is None or fresh.holder != request.holder or \
                fresh.transitions != request.epoch:
            now_holder = "<deleted>" if fresh is None else (fresh.holder or "<none>")
            raise click.ClickException(
                f"leadership changed while requesting (holder now {now_holder}); not asking "
                "a different term to step down: run step-down again if still wanted")
        current = fresh
    raise click.ClickException("the Lease kept changing; step-down not requested")
