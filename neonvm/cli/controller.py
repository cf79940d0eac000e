"""``neonvm controller run``: one controller replica.

Run several (as separate processes, or pods of the chart's Deployment): they campaign
for one Lease, and only the leader reconciles. SIGTERM or SIGINT stops the workers,
releases the per-VM locks and then the Lease, so a standby takes over at once.

Every flag has an environment variable (``NEONVM_CONTROLLER_RUN_<FLAG>``); the etcd
connection also reads ``NEONVM_ETCD_*`` (see ``neonvm locks --help``).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import click
from loguru import logger

from neonvm.api.rights import DEFAULT_RIGHT_SECONDS
from neonvm.cli.exits import ExitCode
from neonvm.controller.config import ControllerConfig, http_pool_size
from neonvm.controller.fault_wiring import wiring_for
from neonvm.controller.faults import FaultConfig, FaultConfigError
from neonvm.controller.leader_endpoint import LeaderEndpoint, endpoint_ip_problem
from neonvm.controller.manager import ControllerProcess
from neonvm.controller.metrics import ControllerMetrics
from neonvm.controller.podspec import DEFAULT_RUNNER_IMAGE, PodDefaults
from neonvm.controller.reconciler import ReconcilerConfig
from neonvm.controller.rights import (
    RIGHTS_WORKERS,
    RightsServer,
    RightsService,
    TokenCache,
    TokenReviewer,
    api_mark_pod,
    parse_bind,
    parse_service,
)
from neonvm.controller.token_verify import TokenVerifier
from neonvm.leader.election import (
    DEFAULT_LEASE_NAME,
    DEFAULT_NAMESPACE,
    AccessRefused,
    ElectionConfig,
    LeaseNamespaceMissing,
    new_identity,
)
from neonvm.leader.epoch import legacy_floor_key
from neonvm.leader.etcd import (
    DEFAULT_TIMEOUT,
    Etcd,
    EtcdConfig,
    EtcdRequestFailed,
    EtcdUnavailable,
)
from neonvm.leader.health import HealthServer
from neonvm.leader.lock import Installation


@click.group("controller", context_settings={"auto_envvar_prefix": "NEONVM_CONTROLLER"})
def controller() -> None:
    """The VirtualMachine controller."""


@controller.command("run")
@click.option("--kubeconfig", type=click.Path(dir_okay=False, path_type=Path),
              envvar="NEONVM_CONTROLLER_RUN_KUBECONFIG",
              help="Kubeconfig [env: NEONVM_CONTROLLER_RUN_KUBECONFIG, set by 'neonvm dev env'; "
                   "else $KUBECONFIG, ~/.kube/config, in-cluster].")
@click.option("--lease-namespace", "--namespace", "lease_namespace",
              default=DEFAULT_NAMESPACE, show_default=True,
              help="Namespace of the leader-election Lease.")
@click.option("--lease-name", default=DEFAULT_LEASE_NAME, show_default=True,
              help="Name of the leader-election Lease.")
@click.option("--identity", default=None,
              help="Leader identity (default: <hostname>_<random>, unique per start).")
@click.option("--lease-duration", type=float, default=4.0, show_default=True)
@click.option("--renew-deadline", type=float, default=2.5, show_default=True)
@click.option("--retry-period", type=float, default=0.5, show_default=True)
@click.option("--etcd-endpoints", metavar="URLS",
              help="Locks' etcd, comma-separated [env: NEONVM_ETCD_ENDPOINTS].")
@click.option("--etcd-prefix", help="Key prefix [env: NEONVM_ETCD_PREFIX; default /neonvm].")
@click.option("--etcd-ca", type=click.Path(dir_okay=False), help="[env: NEONVM_ETCD_CA]")
@click.option("--etcd-cert", type=click.Path(dir_okay=False), help="[env: NEONVM_ETCD_CERT]")
@click.option("--etcd-key", type=click.Path(dir_okay=False), help="[env: NEONVM_ETCD_KEY]")
@click.option("--etcd-timeout", type=float, default=DEFAULT_TIMEOUT, show_default=True)
@click.option("--session-ttl", type=click.IntRange(min=2), default=10, show_default=True,
              help="TTL (s) of the etcd lease the per-VM locks are bound to.")
@click.option("--watch-namespace", default=None,
              help="Reconcile only VMs of this namespace (default: all).")
@click.option("--workers", type=click.IntRange(min=1), default=ControllerConfig().workers,
              show_default=True, help="Reconcile workers in the leader.")
@click.option("--resync", type=click.FloatRange(min=1), default=30.0, show_default=True,
              help="Seconds between resyncs: metadata-only lists of VMs and pods compared "
                   "with the caches; the VMs that differ are re-read directly.")
@click.option("--plan-requeue", type=click.FloatRange(min=0.1), default=2.0,
              show_default=True, help="Seconds between direct re-reads of VMs mid-plan.")
@click.option("--relist", type=click.FloatRange(min=1), default=300.0, show_default=True,
              help="Seconds between full re-lists of the caches (heals missed events).")
@click.option("--sync-deadline", type=click.FloatRange(min=1), default=300.0,
              show_default=True,
              help="Seconds a new leader may take to sync its caches before it steps down "
                   "and releases the Lease for a standby.")
@click.option("--sweep", type=click.FloatRange(min=1), default=ControllerConfig().sweep_seconds,
              show_default=True,
              help="Seconds between sweeps of locks and pods of deleted VMs.")
@click.option("--orphan-grace", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds a pod whose VM is gone may stay before the sweep deletes it (the "
                   "garbage collector normally removes it first).")
@click.option("--heap-trim", type=click.FloatRange(min=0),
              default=ControllerConfig().heap_trim_seconds, show_default=True,
              help="Seconds between malloc_trim calls handing freed heap pages back to the "
                   "kernel (0: never).")
@click.option("--runner-image", default=DEFAULT_RUNNER_IMAGE, show_default=True,
              help="Runner image for VMs without spec.runnerImage.")
@click.option("--kvm-resource", default="", show_default=True,
              help="Extended resource giving runner pods /dev/kvm (NeonVM's: "
                   "devices.kubevirt.io/kvm), requested for VMs with enableAcceleration; "
                   "'' requests none.")
@click.option("--health-port", type=click.IntRange(min=0, max=65535), default=8081,
              show_default=True, help="/healthz, /readyz, /metrics (0: a free port).")
@click.option("--health-host", default="0.0.0.0", show_default=True)
@click.option("--right-seconds", type=click.FloatRange(min=0), default=DEFAULT_RIGHT_SECONDS,
              show_default=True,
              help="Self-fencing: the right to run granted to each runner, in seconds (0: "
                   "off). Needs --rights-url; docs/protocol.md, \"Self-fencing\".")
@click.option("--rights-url", default="",
              help="Self-fencing: the URL runners ask for rights (the Service in front of "
                   "the replicas' --rights-bind). Empty: pods do not self-fence.")
@click.option("--rights-audience", default="",
              help="Self-fencing: runner pods get a projected ServiceAccount token of this "
                   "audience and ask with it; the leader verifies it by a TokenReview "
                   "(needs tokenreviews create, no Secret rights). Empty: runners ask with "
                   "the VM's scaling token (needs Secret rights). docs/security.md, "
                   "\"Rights endpoint\".")
@click.option("--rights-bind", default="",
              help="host:port where this replica serves POST /v1/rights (answered while "
                   "it leads). Empty: not served.")
@click.option("--rights-workers", type=click.IntRange(min=1), default=RIGHTS_WORKERS,
              show_default=True,
              help="Threads answering POST /v1/rights (each may wait on the API server: "
                   "a token's review, a term's write to a pod).")
@click.option("--rights-service", default="", metavar="NAMESPACE/NAME",
              help="Self-fencing: a Service without selector that each leader points at "
                   "itself (an EndpointSlice with --pod-ip and the --rights-bind port).")
@click.option("--pod-ip", default="", envvar="POD_IP",
              help="This replica's IP, for --rights-service [env: POD_IP].")
@click.option("--fault", "faults", multiple=True, metavar="K=V[,K=V]",
              help="Fault injection (testing only; also $NEONVM_FAULTS): crash_after=STEP[@N],"
                   " stale_reads=P, drop_watch_events=P, conflict=P, seed=N, crash_record=PATH.")
def run(kubeconfig: Path | None, lease_namespace: str, lease_name: str, identity: str | None,
        lease_duration: float, renew_deadline: float, retry_period: float,
        etcd_endpoints: str | None, etcd_prefix: str | None, etcd_ca: str | None,
        etcd_cert: str | None, etcd_key: str | None, etcd_timeout: float, session_ttl: int,
        watch_namespace: str | None, workers: int, resync: float, plan_requeue: float,
        relist: float, sync_deadline: float, sweep: float, orphan_grace: float,
        heap_trim: float,
        runner_image: str, kvm_resource: str,
        health_port: int, health_host: str,
        right_seconds: float, rights_url: str, rights_audience: str, rights_bind: str,
        rights_workers: int, rights_service: str,
        pod_ip: str, faults: tuple[str, ...]) -> None:
    """Run one replica: campaign, and while leading keep exactly one runner pod per VM."""
    from neonvm import kube

    try:
        fault_config = FaultConfig.from_env(faults)
    except FaultConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--fault") from None
    try:
        election = ElectionConfig(
            namespace=lease_namespace, name=lease_name, identity=identity or new_identity(),
            lease_duration=lease_duration, renew_deadline=renew_deadline,
            retry_period=retry_period)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    etcd_config = EtcdConfig.from_env().with_overrides(
        endpoints=etcd_endpoints, prefix=etcd_prefix, ca=etcd_ca, cert=etcd_cert,
        key=etcd_key, timeout=etcd_timeout)
    etcd_config.validate()
    config = ControllerConfig(
        workers=workers, watch_namespace=watch_namespace, resync_seconds=resync,
        plan_requeue_seconds=plan_requeue, sweep_seconds=sweep, session_ttl=session_ttl,
        orphan_grace_seconds=orphan_grace, relist_seconds=relist,
        sync_deadline_seconds=sync_deadline, heap_trim_seconds=heap_trim,
        reconciler=ReconcilerConfig(resync_seconds=resync,
                                    pod_defaults=PodDefaults(
                                        runner_image=runner_image,
                                        kvm_resource=kvm_resource or None,
                                        right_seconds=right_seconds,
                                        rights_url=rights_url or None,
                                        rights_audience=rights_audience or None)),
    )
    log = logger.bind(identity=election.identity)
    if fault_config.enabled:
        log.warning("FAULT INJECTION ENABLED: {faults}", faults=fault_config)
    api = kube.api_client(kubeconfig, pool_size=http_pool_size(workers)
                          + (rights_workers if rights_bind else 0))
    metrics = ControllerMetrics()
    process = ControllerProcess(api, etcd_config, election, config,
                                wiring=wiring_for(fault_config), metrics=metrics)
    health = HealthServer(health_port, metrics.registry, host=health_host)
    process.register_health(health)
    rights: RightsServer | None = None
    if rights_bind:
        try:
            host, port = parse_bind(rights_bind)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--rights-bind") from None
        reviewer: TokenReviewer | None = None
        if rights_audience:
            # The issuer keys are fetched now, standbys too, so a term's first asks (one
            # per pod, all at once) are verified locally, not reviewed (docs/security.md).
            verifier = TokenVerifier(api, rights_audience)
            verifier.load()
            reviewer = TokenReviewer(api, rights_audience, verify=verifier.decide)
            process.rights_reviewer = reviewer  # forgets deleted pods' tokens
            metrics.remembered("token_reviews", reviewer.remembered_tokens)
            metrics.remembered("token_review_budgets", reviewer.remembered_budgets)
        tokens = TokenCache(api)
        metrics.remembered("token_secrets", tokens.remembered)
        rights = RightsServer(RightsService(process.rights, process.rights_caches,
                                            tokens,
                                            api_mark_pod(api, process.term_epoch),
                                            registry=metrics.registry,
                                            reviewer=reviewer),
                              host, port, workers=rights_workers)
        # A listener thread that ended would answer no ask again: restart the replica.
        health.add_check("rights-listener", rights.health_check, readiness=False)
        if rights_service:
            try:
                service_namespace, service = parse_service(rights_service)
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint="--rights-service") from None
            if not pod_ip:
                raise click.UsageError("--rights-service needs --pod-ip (or $POD_IP)")
            problem = endpoint_ip_problem(pod_ip)
            if problem is not None:
                raise click.BadParameter(problem, param_hint="--pod-ip")
            process.rights_endpoint = LeaderEndpoint(api, service_namespace, service,
                                                     pod_ip, port)
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("received {sig}: stopping", sig=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    health.start()
    if rights is not None:
        rights.start()
    log.info("controller replica starting: lease {ns}/{name}, etcd {etcd}, {w} workers",
             ns=lease_namespace, name=lease_name, etcd=",".join(etcd_config.endpoints),
             w=workers)
    try:
        if not _etcd_admits(process.etcd, etcd_config.prefix, process.installation, log):
            sys.exit(ExitCode.UNREACHABLE)
        process.run(stop)
    except AccessRefused as exc:
        # Revoked while running: the term (if any) ended and the Lease was released.
        log.error("stopping: {err}; {fix}", err=str(exc), fix=_etcd_fix(etcd_config.prefix))
        sys.exit(ExitCode.UNREACHABLE)
    except LeaseNamespaceMissing as exc:
        # A configuration error: one line, exit 1 (under Kubernetes the pod restarts
        # with backoff and `kubectl logs --previous` shows this line).
        log.error("cannot campaign: {err}", err=str(exc))
        sys.exit(1)
    finally:
        if rights is not None:
            rights.stop()
        health.stop()
        api.close()
    log.info("controller replica stopped")


def _etcd_admits(etcd: Etcd, prefix: str, installation: Installation, log: Any) -> bool:
    """Before campaigning: may this replica's etcd identity read and write its keys?

    A refusal is a configuration error (the role of its certificate's user is for
    another prefix, say): logged once, in one line, and the replica exits 3 rather than
    take the Lease and retry a refusal forever. An etcd that does not answer is an
    outage, not a configuration: the replica campaigns as usual (docs/locks.md,
    "Failure behaviour")."""
    root = installation.root(prefix) + "/"
    try:
        etcd.check_access(root, read=[legacy_floor_key(prefix)])
    except EtcdUnavailable as exc:
        log.warning("could not check this replica's access to the locks' etcd ({err}); "
                    "campaigning anyway", err=str(exc))
    except EtcdRequestFailed as exc:
        log.error("cannot campaign: {err}; {fix}", err=str(exc), fix=_etcd_fix(prefix))
        return False
    return True


def _etcd_fix(prefix: str) -> str:
    return (f"give this replica's etcd user (its client certificate's CN, or "
            f"NEONVM_ETCD_USER) a role that reads and writes {prefix}/ (docs/locks.md, "
            "'Configuration')")
