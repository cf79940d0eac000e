"""``neonvm locks``: inspect, watch and break the per-VM locks in etcd.

Connection settings come from ``NEONVM_ETCD_*`` (``neonvm dev env`` prints them for the
local cluster) and can be overridden by the group's flags. Every command gives up with a
one-line error after ``--timeout`` seconds when etcd does not answer.

Locks belong to an installation, named by its Lease: the commands act on the one that
``--lease-namespace``/``--lease-name`` name, with the same defaults and environment
variables as ``neonvm controller run``; ``list`` and ``watch`` take
``--all-installations``. ``-A/--all-namespaces`` means what it means to kubectl: every
namespace, which is what ``list`` and ``watch`` show without ``-n``.

``-o json|yaml`` prints this command's own document (locks are etcd keys, not Kubernetes
objects).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import click
import yaml

from neonvm.cli.output import (
    JSONPATH,
    NO_HEADERS_OPTION,
    OUTPUT_OPTION,
    cell,
    emit,
    render_jsonpath,
)
from neonvm.leader.election import DEFAULT_LEASE_NAME, DEFAULT_NAMESPACE
from neonvm.leader.etcd import DEFAULT_TIMEOUT, Etcd, EtcdConfig
from neonvm.leader.lock import Installation, LockEvent, LockInfo, LockTable

LIST_COLUMNS = ["namespace", "name", "status", "holder", "epoch", "token", "vmUID", "ttl",
                "age"]
_CLOSE_SECONDS = 5.0  # how long Ctrl-C waits for the closed stream before exiting anyway
ALL_OPTION = click.option("--all-installations", "all_installations", is_flag=True,
                          help="Locks of every installation under the prefix, not only the "
                               "one of --lease-namespace/--lease-name.")
NAMESPACE_OPTION = click.option("-n", "--namespace", help="Only this namespace.")
ALL_NAMESPACES_OPTION = click.option(
    "-A", "--all-namespaces", is_flag=True,
    help="Every namespace (as kubectl's -A; also the default without -n). Every "
         "installation is --all-installations.")


def _namespace(namespace: str | None, all_namespaces: bool) -> str | None:
    """The namespace to show (None: all); -n with -A is a usage error, as in kubectl."""
    if namespace and all_namespaces:
        raise click.UsageError("-n/--namespace and -A/--all-namespaces exclude each other")
    return namespace


@dataclass(frozen=True)
class _Settings:
    etcd: EtcdConfig
    installation: Installation


@click.group("locks")
@click.option("--endpoints", metavar="URLS",
              help="Comma-separated http(s)://host:port [env: NEONVM_ETCD_ENDPOINTS].")
@click.option("--prefix", help="Key prefix [env: NEONVM_ETCD_PREFIX; default /neonvm].")
@click.option("--ca", type=click.Path(dir_okay=False), help="CA bundle [env: NEONVM_ETCD_CA].")
@click.option("--cert", type=click.Path(dir_okay=False),
              help="Client certificate [env: NEONVM_ETCD_CERT].")
@click.option("--key", type=click.Path(dir_okay=False),
              help="Client key [env: NEONVM_ETCD_KEY].")
@click.option("--user", help="etcd user [env: NEONVM_ETCD_USER].")
@click.option("--password", help="etcd password [env: NEONVM_ETCD_PASSWORD].")
@click.option("--timeout", type=float, default=DEFAULT_TIMEOUT, show_default=True,
              help="Seconds to wait for etcd before giving up.")
@click.option("--lease-namespace", default=DEFAULT_NAMESPACE, show_default=True,
              envvar="NEONVM_CONTROLLER_RUN_LEASE_NAMESPACE",
              help="The installation: namespace of its controller's Lease "
                   "[env: NEONVM_CONTROLLER_RUN_LEASE_NAMESPACE].")
@click.option("--lease-name", default=DEFAULT_LEASE_NAME, show_default=True,
              envvar="NEONVM_CONTROLLER_RUN_LEASE_NAME",
              help="The installation: name of its controller's Lease "
                   "[env: NEONVM_CONTROLLER_RUN_LEASE_NAME].")
@click.pass_context
def locks(ctx: click.Context, endpoints: str | None, prefix: str | None, ca: str | None,
          cert: str | None, key: str | None, user: str | None, password: str | None,
          timeout: float, lease_namespace: str, lease_name: str) -> None:
    """Per-VM locks: who holds which VM, under which epoch and fencing token.

    Each controller installation keeps its own locks, under
    PREFIX/LEASE-NAMESPACE/LEASE-NAME/locks/; the commands act on the installation named
    by --lease-namespace and --lease-name (the controller's defaults unless given).
    """
    try:
        installation = Installation(lease_namespace, lease_name)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--lease-namespace/--lease-name"
                                 ) from None
    ctx.obj = _Settings(EtcdConfig.from_env().with_overrides(
        endpoints=endpoints, prefix=prefix, ca=ca, cert=cert, key=key, user=user,
        password=password, timeout=timeout,
    ), installation)


@contextmanager
def _table(ctx: click.Context, all_installations: bool = False) -> Iterator[LockTable]:
    settings: _Settings = ctx.obj
    etcd = Etcd(settings.etcd)
    try:
        yield LockTable(etcd, settings.etcd.prefix,
                        None if all_installations else settings.installation)
    finally:
        etcd.close()


def _parse_ref(ref: str) -> tuple[str, str]:
    namespace, sep, name = ref.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise click.BadParameter(f"want NAMESPACE/NAME, got {ref!r}", param_hint="LOCK")
    return namespace, name


def _rows(table: LockTable, infos: list[LockInfo]) -> list[dict[str, Any]]:
    ttls = table.lease_ttls(infos)
    now = time.time()
    return [i.as_dict(now, ttls.get(i.lease)) for i in infos]


@locks.command("list")
@NAMESPACE_OPTION
@ALL_NAMESPACES_OPTION
@ALL_OPTION
@NO_HEADERS_OPTION
@OUTPUT_OPTION
@click.pass_context
def list_(ctx: click.Context, namespace: str | None, all_namespaces: bool,
          all_installations: bool, no_headers: bool, output: str) -> None:
    """List locks: holder, epoch, token (fencing), lease seconds left, age."""
    namespace = _namespace(namespace, all_namespaces)
    with _table(ctx, all_installations) as table:
        rows = _rows(table, table.list(namespace))
    columns = (["installation", *LIST_COLUMNS] if all_installations else LIST_COLUMNS)
    emit(rows, output, None if output != "table" else columns, no_headers=no_headers,
         namespace=namespace)


@locks.command("show")
@click.argument("lock", metavar="NAMESPACE/NAME")
@OUTPUT_OPTION
@click.pass_context
def show(ctx: click.Context, lock: str, output: str) -> None:
    """Show one lock in full (a malformed value is shown as such, with its raw text)."""
    namespace, name = _parse_ref(lock)
    with _table(ctx) as table:
        info = table.get(namespace, name)
        if info is None:
            raise click.ClickException(f"no lock for {namespace}/{name}")
        row = _rows(table, [info])[0]
    if output == "table":
        width = max(len(k) for k in row)
        for k, v in row.items():
            click.echo(f"{k + ':':<{width + 1}} {cell(v)}")
        return
    emit(row, output)


@locks.command("watch")
@NAMESPACE_OPTION
@ALL_NAMESPACES_OPTION
@click.option("--no-existing", is_flag=True, help="Skip the locks that exist at the start.")
@ALL_OPTION
@OUTPUT_OPTION
@click.pass_context
def watch(ctx: click.Context, namespace: str | None, all_namespaces: bool, no_existing: bool,
          all_installations: bool, output: str) -> None:
    """Stream lock changes (taken, taken over, released, expired) until Ctrl-C.

    First prints the current locks as EXISTING, then every change as it happens. json
    prints one object per line; yaml one document per change.
    """
    namespace = _namespace(namespace, all_namespaces)
    stopped = threading.Event()
    failure: list[BaseException] = []

    def stream(table: LockTable) -> None:
        try:
            for event in table.watch(namespace, existing=not no_existing):
                if stopped.is_set():
                    return
                _print_event(event, output, all_installations)
        except BaseException as exc:  # handed to the main thread, which reports it
            failure.append(exc)
        finally:
            stopped.set()

    # Ctrl-C only raises a flag. A KeyboardInterrupt raised inside gRPC's own locking
    # can leave a lock held and the process hung, so the stream runs on its own thread
    # and the main thread only waits; closing the channels ends the stream.
    interrupted = False

    def on_signal(_signum: int, _frame: object) -> None:
        nonlocal interrupted
        interrupted = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with _table(ctx, all_installations) as table:
            worker = threading.Thread(target=stream, args=(table,), name="locks-watch",
                                      daemon=True)
            worker.start()
            while not interrupted and worker.is_alive():
                worker.join(0.2)
            stopped.set()
        worker.join(_CLOSE_SECONDS)  # the channels are closed: the stream ends soon
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if failure and not interrupted:
        raise failure[0]


def _print_event(event: LockEvent, fmt: str, with_installation: bool) -> None:
    row = {"event": event.kind.upper(), "revision": event.revision,
           **event.info.as_dict()}
    if fmt == "json":
        click.echo(json.dumps(row, default=str))
    elif fmt == "yaml":
        click.echo("---\n" + yaml.safe_dump(row, sort_keys=False).rstrip())
    elif fmt.startswith(JSONPATH):
        click.echo(render_jsonpath(fmt, row), nl=False)
    else:
        stamp = datetime.now(UTC).strftime("%H:%M:%S")
        if event.info.record is None and event.kind != "delete":
            what = f"malformed: {event.info.malformed}"
        else:
            r = event.info.record
            what = (f"holder={r.holder} epoch={r.epoch} vm-uid={r.vm_uid}" if r
                    else "(malformed)")
        where = f"[{event.info.installation}] " if with_installation else ""
        click.echo(f"{stamp} {event.kind.upper():<8} {where}{event.info.namespace}/"
                   f"{event.info.name} token={event.info.token} {what}", nl=True)
    sys.stdout.flush()


@locks.command("break")
@click.argument("lock", metavar="NAMESPACE/NAME")
@click.option("--force", is_flag=True, help="Required: confirms you mean it.")
@OUTPUT_OPTION
@click.pass_context
def break_(ctx: click.Context, lock: str, force: bool, output: str) -> None:
    """Delete a VM's lock, whoever holds it.

    Use it for a lock left behind (say, by a holder whose lease was revoked by hand but
    whose key was not, or a malformed value), or to make a stuck holder let go at once.

    It is safe: every write a holder makes is fenced by its token (the lock key's
    revision must still be the token it was given) and by its epoch, so a holder whose
    lock was broken is refused at its next write and can do no harm; the next holder gets
    a higher token. Breaking a lock costs progress, never safety. The current leader
    simply takes the lock again on its next reconcile.
    """
    namespace, name = _parse_ref(lock)
    if not force:
        raise click.UsageError(
            f"refusing to break {namespace}/{name} without --force (see --help: safe, "
            "because holders' writes are fenced by token and epoch)")
    with _table(ctx) as table:
        info = table.break_lock(namespace, name)
    if info is None:
        raise click.ClickException(f"no lock for {namespace}/{name}")
    if output == "table":
        r = info.record
        who = f"{r.holder} (epoch {r.epoch})" if r else "a malformed value"
        click.echo(f"broke lock {namespace}/{name}: was held by {who}, token {info.token}")
        return
    emit(info.as_dict(), output)

