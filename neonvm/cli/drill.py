"""``neonvm drill``: failover drills with a verdict, and the fault-injection campaign.

Each drill creates ``--vms`` VMs in a fresh drill namespace, injects one fault while an
independent checker watches every pod revision, and prints a verdict: failover time,
convergence time and duplicates seen (must be 0). It exits 1 on any violation.

Target: the local control plane of ``--state-dir`` (default the ``neonvm dev`` one; the
drill starts it, and ``--replicas`` controller replicas, if they are not running), or,
with ``--kubeconfig``, a cluster where the chart runs the controller. Against a real
cluster every drill is destructive and refuses to run without ``--yes``; ``stale-read``,
``etcd-restart`` and ``apiserver-restart`` run only locally.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from neonvm.cli.dev import STATE_DIR_OPTION
from neonvm.cli.output import OUTPUT_OPTION, emit
from neonvm.drills.drills import DRILLS, LOCAL_ONLY, DrillOptions, Verdict, run_drill
from neonvm.drills.infra import RECORDED
from neonvm.drills.target import DrillError, KubeTarget, LocalTarget, Target


def _progress(msg: str) -> None:
    click.echo(f"  {msg}", err=True)


def _common(f: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        STATE_DIR_OPTION,
        click.option("--kubeconfig", type=click.Path(dir_okay=False, path_type=Path),
                     default=None, help="Drill a real cluster instead of the local one."),
        click.option("--yes", is_flag=True,
                     help="Confirm a destructive drill against a real cluster."),
        click.option("--pods", is_flag=True,
                     help="The controller of the --state-dir cluster runs as the chart's "
                          "pods on its real node (docs/real-node.md): drill those pods "
                          "(KILL: SIGKILL to the leader container's process), with the "
                          "cluster's locks' etcd for the lock checks."),
        click.option("--vms", type=click.IntRange(1, 5000), default=10, show_default=True,
                     help="VMs created in the drill namespace."),
        click.option("--replicas", type=click.IntRange(1, 9), default=3, show_default=True,
                     help="Controller replicas (local: started if fewer are running)."),
        click.option("--disturb", type=click.FloatRange(0, 1), default=0.2,
                     show_default=True,
                     help="Share of VMs whose pods are deleted to keep the leader busy."),
        click.option("--timeout", type=click.FloatRange(10), default=300.0,
                     show_default=True, help="Seconds allowed to converge."),
        click.option("--seed", type=int, default=None, help="Seed of the drill's choices."),
        click.option("--lease-namespace", default="neonvm-system", show_default=True),
        click.option("--lease-name", default="neonvm-controller", show_default=True),
        click.option("--keep", is_flag=True, help="Leave the drill namespace and VMs."),
        click.option("--timeline", type=click.Path(dir_okay=False), default=None,
                     help="Write the drill's timeline as an SVG picture to this path."),
        click.option("--write-docs", is_flag=True,
                     help="Record the verdict (infrastructure drills) in docs/drills.md."),
        OUTPUT_OPTION,
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _target(name: str, state_dir: Path | None, kubeconfig: Path | None, yes: bool,
            replicas: int, lease_namespace: str, lease_name: str, pods: bool = False
            ) -> Target:
    if pods:
        from neonvm import kube
        from neonvm.dev.cluster import LocalCluster

        if kubeconfig is not None or name in LOCAL_ONLY:
            raise click.UsageError(f"--pods drills the chart's pods of the --state-dir "
                                   f"cluster: not with --kubeconfig, nor {', '.join(LOCAL_ONLY)}")
        cluster = LocalCluster(state_dir)
        return KubeTarget(kube.api_client(cluster.kubeconfig), cluster.kubeconfig,
                          lease_namespace, lease_name, etcd_endpoints=cluster.locks_etcd_config(),
                          same_host=True)
    if kubeconfig is None:
        return LocalTarget.prepare(state_dir, replicas, _progress)
    from neonvm.dev.cluster import LocalCluster

    local = LocalCluster(state_dir)
    if local.kubeconfig.resolve() == kubeconfig.resolve():
        return LocalTarget.prepare(state_dir, replicas, _progress)
    if name in LOCAL_ONLY:
        raise click.UsageError(f"{name} runs only against the local control plane "
                               f"(drop --kubeconfig)")
    if not yes:
        raise click.UsageError(f"{name} is destructive (it kills, pauses or deletes things "
                               f"in {kubeconfig}); add --yes to run it there")
    from neonvm import kube

    return KubeTarget(kube.api_client(kubeconfig), kubeconfig, lease_namespace, lease_name)


def _emit(verdict: Verdict, output: str) -> None:
    if output != "table":
        emit(verdict.as_dict(), output)
    else:
        rows = verdict.rows()
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            click.echo(f"{k + ':':<{width + 1}} {v}")


def _run(name: str, output: str, state_dir: Path | None, kubeconfig: Path | None,
         yes: bool, pods: bool, replicas: int, lease_namespace: str, lease_name: str,
         write_docs: bool, **opts: Any) -> None:
    if write_docs and name not in RECORDED:
        raise click.UsageError(f"--write-docs records infrastructure drills only "
                               f"({', '.join(RECORDED)})")
    target = _target(name, state_dir, kubeconfig, yes, replicas, lease_namespace, lease_name,
                     pods)
    try:
        verdict = run_drill(name, target, DrillOptions(**opts), _progress)
    except DrillError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        target.close()
    _emit(verdict, output)
    if write_docs:
        from neonvm.drills.record import write_docs as record

        click.echo(f"recorded in {record(verdict, _command_line(name))}", err=True)
    if not verdict.ok:
        sys.exit(1)


def _command_line(name: str) -> str:
    """The command as typed, without the paths that only this machine has."""
    args = sys.argv[sys.argv.index(name) + 1:] if name in sys.argv else []
    kept: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("--state-dir", "--timeline", "-o", "--output"):
            skip = True
            continue
        if a == "--write-docs" or a.startswith(("--state-dir=", "--timeline=")):
            continue
        kept.append(a)
    return " ".join(["neonvm drill", name, *kept])


@click.group("drill")
def drill() -> None:
    """Failover drills (verdict: failover, convergence, duplicates) and the campaign."""


def _command(name: str, help_text: str, extra: list[Callable[..., Any]] | None = None
             ) -> None:
    def body(**kwargs: Any) -> None:
        _run(name, **kwargs)

    cmd = _common(body)
    for option in extra or []:
        cmd = option(cmd)
    drill.command(name, help=help_text)(cmd)


_command("kill-leader", "Kill the leader while it re-plans; a standby must take over.",
         [click.option("--signal", type=click.Choice(["KILL", "TERM"], case_sensitive=False),
                       default="KILL", show_default=True,
                       help="KILL: no clean-up; TERM: graceful release.")])
_command("pause-leader", "SIGSTOP the leader past its lease, then SIGCONT: it must do no harm.",
         [click.option("--pause-seconds", type=click.FloatRange(0), default=None,
                       help="How long to keep it stopped [default: until another leads, "
                            "+3s].")])
_command("pod-storm", "Delete runner pods as fast as possible; replacements must never overlap.",
         [click.option("--storm-seconds", type=click.FloatRange(1), default=15.0,
                       show_default=True)])
_command("break-lock", "Break the VMs' locks (locks break --force) while the leader works.",
         [click.option("--rounds", type=click.IntRange(1, 100), default=3, show_default=True)])
_command("stale-read", "Local: restart replicas with stale reads, lost events and conflicts.",
         [click.option("--faults", default="stale_reads=0.5,drop_watch_events=0.3,conflict=0.2",
                       show_default=True, help="Fault spec (seed added from --seed).")])
_command("etcd-restart", "Local: restart the locks' etcd, then the API server's etcd.")
_CHURN = [
    click.option("--churn-interval", type=click.FloatRange(0.5), default=5.0,
                 show_default=True, help="Seconds between churn rounds during the fault."),
    click.option("--churn-share", type=click.FloatRange(0, 1), default=0.1,
                 show_default=True,
                 help="Share of VMs whose runner pods each churn round deletes."),
]
_PARTITION = [
    click.option("--partition-seconds", type=click.FloatRange(1), default=30.0,
                 show_default=True, help="How long the victim is cut off."),
    click.option("--victim", type=click.Choice(["leader", "standby"]), default="leader",
                 show_default=True, help="Which replica is cut off."),
    *_CHURN,
]
_command("apiserver-restart", "Local: restart kube-apiserver while the leader works, under "
                              "churn.", _CHURN)
_command("etcd-outage", "Local: stop the locks' etcd for a while under churn, then start it.",
         [click.option("--outage-seconds", type=click.FloatRange(1), default=60.0,
                       show_default=True, help="How long the locks' etcd stays stopped."),
          *_CHURN])
_command("slow-api", "Local: replicas reach the API server through a proxy that delays "
                     "every request, under churn.",
         [click.option("--latency", type=click.FloatRange(0), default=1.5, show_default=True,
                       help="Seconds added to every request."),
          click.option("--slow-seconds", type=click.FloatRange(1), default=300.0,
                       show_default=True, help="How long the API server stays slow."),
          *_CHURN])
_command("partition-etcd", "Local: cut one replica off the locks' etcd (not the API "
                           "server) under churn.", _PARTITION)
_command("partition-api", "Local: cut one replica off the API server (not the locks' "
                          "etcd) under churn.", _PARTITION)
_command("etcd-member-kill", "Local: the locks on a 3-member etcd; kill the member every "
                             "replica names first, under churn, then start it again.",
         [click.option("--outage-seconds", type=click.FloatRange(1), default=60.0,
                       show_default=True, help="How long the killed member stays down."),
          *_CHURN])


# ---- self-fencing drills on two real nodes (docs/drills.md) --------------------------------

FENCING_DRILLS = {
    "power-off": ("power-off", "Two real nodes: freeze the VM's node (kubelet, containerd, "
                  "runners, QEMU: SIGSTOP) and cut its pods' network; the VM must come back "
                  "on the other node, never with two guests running."),
    "partition-node": ("partition", "Two real nodes: the VM's node cannot reach the API "
                       "server nor the leader; its runner must kill its guest before its "
                       "deadline, then the VM comes back on the other node."),
    "kubelet-crash": ("kubelet-crash", "Two real nodes: SIGKILL the kubelet of the VM's "
                      "node and keep it down; its runner still renews: nothing may be "
                      "replaced."),
    "freeze-thaw": ("freeze-thaw", "Two real nodes: freeze the VM's node past the deadline, "
                    "let the VM be replaced, then thaw the node (QEMU first): measures how "
                    "long the old guest runs after the thaw."),
}
"""``neonvm drill NAME`` -> the drill of :mod:`neonvm.drills.fencing` and its help."""


def _fencing_command(name: str, drill_name: str, help_text: str) -> None:
    from neonvm.api.rights import DEFAULT_RIGHT_SECONDS

    @drill.command(name, help=help_text + " Each under a SIGKILL of the leader at a random "
                   "moment. Needs `neonvm dev up --real-nodes 2` on --state-dir "
                   "(docs/real-node.md); exits 1 on any failed run.")
    @STATE_DIR_OPTION
    @click.option("--real-nodes", type=click.IntRange(2, 2), default=2, show_default=True,
                  help="Real kubelet nodes of the --state-dir cluster the drill uses.")
    @click.option("--repeat", type=click.IntRange(1, 1000), default=1, show_default=True)
    @click.option("--right-seconds", type=click.FloatRange(1), default=DEFAULT_RIGHT_SECONDS,
                  show_default=True, help="D: each right to run lasts this long.")
    @click.option("--replicas", type=click.IntRange(1, 9), default=3, show_default=True,
                  help="Self-fencing controller replicas the drill starts.")
    @click.option("--seed", type=int, default=None, help="Seed of the leader-kill moments.")
    @click.option("--no-leader-kill", is_flag=True, help="Do not kill the leader.")
    @click.option("--fresh-vm", is_flag=True,
                  help="A new VM for each run (no restart streak carried over).")
    @click.option("--reuse-images", is_flag=True,
                  help="Keep the runner image the nodes have (only if neonvm/ is unchanged).")
    @click.option("--timeline", type=click.Path(dir_okay=False, path_type=Path), default=None,
                  help="Write the first run's timeline as an SVG picture to this path.")
    @OUTPUT_OPTION
    def body(state_dir: Path | None, real_nodes: int, repeat: int, right_seconds: float,
             replicas: int, seed: int | None, no_leader_kill: bool, fresh_vm: bool,
             reuse_images: bool, timeline: Path | None, output: str) -> None:
        from neonvm.dev.common import default_state_dir
        from neonvm.drills import fencing

        fencing.install_sigterm()
        results, out = fencing.run_drills(
            state_dir or default_state_dir(),
            fencing.Options(drills=[drill_name], repeat=repeat, right_seconds=right_seconds,
                            replicas=replicas, seed=seed, leader_kill=not no_leader_kill,
                            fresh_vm=fresh_vm, reuse_images=reuse_images, timeline=timeline),
            _progress)
        doc = {"drill": name, "summary": out.get(drill_name, {}),
               "runs": [r.__dict__ for r in results]}
        if output != "table":
            emit(doc, output)
        else:
            for r in results:
                click.echo(r.line())
            for k, v in doc["summary"].items():
                click.echo(f"{k}: {v}")
        if not all(r.ok for r in results):
            sys.exit(1)


for _name, (_drill, _help) in FENCING_DRILLS.items():
    _fencing_command(_name, _drill, _help)


@drill.command("all")
@STATE_DIR_OPTION
@click.option("--vms", type=click.IntRange(1, 5000), default=10, show_default=True)
@click.option("--replicas", type=click.IntRange(1, 9), default=3, show_default=True)
@click.option("--timeout", type=click.FloatRange(10), default=300.0, show_default=True)
@OUTPUT_OPTION
def all_(state_dir: Path | None, vms: int, replicas: int, timeout: float, output: str) -> None:
    """Every drill in turn against the local control plane; a summary table at the end."""
    verdicts: list[Verdict] = []
    runs: list[tuple[str, dict[str, Any]]] = [
        ("kill-leader", {"signal": "KILL"}), ("kill-leader", {"signal": "TERM"}),
        ("pause-leader", {}), ("pod-storm", {}), ("break-lock", {}), ("stale-read", {}),
        ("etcd-restart", {}), ("apiserver-restart", {}),
    ]
    for name, extra in runs:
        click.echo(f"== {name} {extra or ''}", err=True)
        target = LocalTarget.prepare(state_dir, replicas, _progress)
        try:
            verdicts.append(run_drill(name, target, DrillOptions(vms=vms, timeout=timeout,
                                                                 **extra), _progress))
        finally:
            target.close()
    if output != "table":
        emit([v.as_dict() for v in verdicts], output)
    else:
        click.echo(summary_table(verdicts))
    if not all(v.ok for v in verdicts):
        sys.exit(1)


def summary_table(verdicts: list[Verdict]) -> str:
    """A markdown table of verdicts (what docs/drills.md records)."""

    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = ["| drill | VMs | verdict | failover s | convergence s | duplicates "
             "(strict/loose) | pod events watched | fault |",
             "|---|---:|---|---:|---:|---:|---:|---|"]
    for v in verdicts:
        fault = "; ".join(f"{k} {val}" for k, val in v.fault.items() if k != "failover_s")
        lines.append(f"| {v.drill} | {v.vms} | {'PASS' if v.ok else 'FAIL'} | "
                     f"{sec(v.failover_seconds)} | {sec(v.convergence_seconds)} | "
                     f"{v.duplicates}/{v.duplicates_loose} | {v.watch.get('pod_events', 0)} | "
                     f"{fault} |")
    return "\n".join(lines)


@drill.command("list")
def list_() -> None:
    """The drills, and which run only locally."""
    for name in DRILLS:
        click.echo(f"{name}{'  (local only)' if name in LOCAL_ONLY else ''}")
    for name in FENCING_DRILLS:
        click.echo(f"{name}  (two real nodes)")


@drill.command("campaign")
@STATE_DIR_OPTION
@click.option("--seed", type=int, default=None,
              help="Campaign seed [default: $NEONVM_CAMPAIGN_SEED, else random].")
@click.option("--schedule", "only", type=int, multiple=True,
              help="Run only this schedule index (repeatable): replays a failure.")
@click.option("--schedules", type=click.IntRange(1), default=20, show_default=True,
              help="How many schedules (indexes 0..N-1) when --schedule is not given.")
@click.option("--budget", type=click.FloatRange(1), default=None,
              help="Stop starting schedules after this many seconds.")
@click.option("--workers", type=click.IntRange(1, 8), default=1, show_default=True,
              help="Schedules run at the same time (each isolated; restarts serialised).")
@click.option("--keep-going", is_flag=True, help="Do not stop at the first failure.")
@click.option("--show", is_flag=True, help="Only print the schedules; run nothing.")
@OUTPUT_OPTION
def campaign(state_dir: Path | None, seed: int | None, only: tuple[int, ...], schedules: int,
             budget: float | None, workers: int, keep_going: bool, show: bool,
             output: str) -> None:
    """Run seeded fault schedules against the local control plane (the tests' campaign).

    Each schedule runs its own controller replicas (own Lease, own namespace, own lock
    prefix) with the schedule's faults, creates a few VMs, disrupts, waits for
    convergence, deletes the VMs and checks that nothing is left. Any failure prints the
    command that replays it.
    """
    from neonvm.drills import campaign as c

    seed = c.campaign_seed(seed)
    indexes = list(only) if only else list(range(schedules))
    plans = [c.generate(seed, i) for i in indexes]
    if show:
        for plan in plans:
            click.echo(plan.describe())
        return
    target = LocalTarget.prepare(state_dir, 0, _progress)
    running = [i for i in range(9) if target.replica_alive(i)]
    if running:
        # They watch every namespace and would reconcile the schedules' VMs too.
        _progress(f"stopping the cluster's own controller replicas ({len(running)}) for "
                  f"the campaign; the next drill or demo starts them again")
        for i in running:
            target.cluster.stop_component(target.replica_name(i))
    started = time.monotonic()
    try:
        result = c.run_campaign(target.cluster, plans, progress=_progress, budget=budget,
                                stop_at_first_failure=not keep_going, workers=workers)
    finally:
        target.close()
    if output == "table":
        click.echo(result.summary(time.monotonic() - started))
    else:
        emit(result.as_dict(), output)
    if not result.ok:
        sys.exit(1)
