"""``neonvm demo``: the whole system on one machine, with a live status view.

It starts (or reuses) the local control plane with simulated nodes and, where the host
allows, one real kubelet node (``neonvm.dev.realguest``), runs several controller
replicas as separate processes, and applies a VM: with the real node, a tiny VM whose
runner pod boots its guest under QEMU there (its console in ``kubectl logs``); without
it (``--no-real-node``, or when a real node cannot start, said in one line), the sample
VM from the original bug report on the simulated nodes. It shows leader, VMs, runner
pods and locks while an independent checker counts duplicate live pods. Everything keeps
running afterwards for you to poke at (``neonvm dev down`` stops it), unless ``--down``
is given.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import yaml
from kubernetes import client

from neonvm import kube, overview
from neonvm.api import types
from neonvm.cli.dev import STATE_DIR_OPTION, print_exports
from neonvm.dev.binaries import install_binaries
from neonvm.dev.cluster import ClusterSpec, LocalCluster
from neonvm.dev.replica import LEASE_NAMESPACE, local_replica_argv, replica_env
from neonvm.invariant import InvariantChecker

SAMPLE_VM = Path(__file__).resolve().parents[2] / "examples" / "vm-deploy.yaml"


def _progress(msg: str) -> None:
    click.echo(f"  {msg}", err=True)


def start_replicas(cluster: LocalCluster, count: int) -> None:
    api = kube.api_client(cluster.kubeconfig)
    with contextlib.suppress(client.ApiException):
        client.CoreV1Api(api).create_namespace(
            client.V1Namespace(metadata=client.V1ObjectMeta(name=LEASE_NAMESPACE))
        )
    api.close()
    for i in range(count):
        pid = cluster.start_process(f"controller-{i}", local_replica_argv(cluster, i),
                                    replica_env())
        _progress(f"controller-{i}: pid {pid}, log {cluster.log_file(f'controller-{i}')}")


def apply_sample_vm(api: client.ApiClient, namespace: str = "default") -> str:
    obj: dict[str, Any] = yaml.safe_load(SAMPLE_VM.read_text())
    custom = client.CustomObjectsApi(api)
    try:
        custom.create_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, obj
        )
    except client.ApiException as e:
        if e.status != 409:
            raise
    return f"{namespace}/{obj['metadata']['name']}"


REAL_VM = "guest"


def apply_real_vm(api: client.ApiClient, namespace: str = "default") -> str:
    """A tiny VM whose runner pod boots the guest disk on the real node."""
    from neonvm.dev import realguest

    spec = realguest.vm_spec(args=("hello", "from", "the", "demo"))
    spec["restartPolicy"] = "Always"
    spec["terminationGracePeriodSeconds"] = 30
    obj = {"apiVersion": types.API_VERSION, "kind": types.KIND,
           "metadata": {"name": REAL_VM}, "spec": spec}
    with contextlib.suppress(client.ApiException):
        client.CustomObjectsApi(api).create_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, obj)
    return f"{namespace}/{REAL_VM}"


def fallback_reason(exc: BaseException) -> str:
    """One line saying why the real node did not start, from any exception.

    Errors from a failed start carry the process's last log lines after a first line
    ending in "last log lines:"; the line keeps the first and the last non-empty one
    (usually the process's own error), so it still says why.
    """
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    first = lines[0] if lines else "(no message)"
    if len(lines) == 1 and first.endswith("; last log lines:"):
        first = first.removesuffix("; last log lines:") + " (its log is empty)"
    text = f"{type(exc).__name__}: {first}"
    if len(lines) > 1:
        text += f" ... {lines[-1]}"
    return text if len(text) <= 300 else text[:297] + "..."


def first_run_note(real_node: bool) -> str | None:
    """What a first run costs (one line), when something is still to be built."""
    from neonvm.dev import binaries, realnode

    groups = ["etcd", "kubernetes", "kwok", *(realnode.GROUPS if real_node else ())]
    missing = [binaries.GROUPS[g].key for g in groups
               if not all(binaries.find(b) for b in binaries.GROUPS[g].binaries)]
    if not missing:
        return None
    return (f"first run: building {', '.join(missing)} from source into "
            f"{binaries.cache_root()} (once; measured cold on 2 cores: about 13 "
            "minutes with the real node, kube-apiserver about 9 of them; see "
            "docs/real-node.md). Later runs set up in about half a minute.")


class Prebuild:
    """The real node's binaries (but the kubelet), kwok and the runner image, built in
    the background while etcd and kube-apiserver build in the foreground.

    Cold, the demo is mostly Go compiles and the runner image. The image is mostly
    downloads and dpkg (little CPU), and each Go build leaves a core idle while it
    fetches modules and links, so running them side by side cuts the wall time. The
    kubelet is left to the foreground, after the control plane: it shares most packages
    with kube-apiserver, which Go's build cache then holds. Everything goes to the same
    caches (and their locks) as a plain build, so :func:`realguest.prepare` afterwards
    finds it built, or waits for it.
    """

    def __init__(self, say: Callable[[str], None], heartbeat: float = 60.0) -> None:
        self.say = say
        self.errors: list[str] = []
        self.current: dict[str, str] = {}
        self.begun = time.monotonic()
        self._done = threading.Event()
        self.threads = [threading.Thread(target=self._task, args=(name, fn), daemon=True)
                        for name, fn in (("node binaries", self._binaries),
                                         ("runner image", self._image))]
        for t in self.threads:
            t.start()
        self._ticker = threading.Thread(target=self._tick, args=(heartbeat,), daemon=True)
        self._ticker.start()

    def _task(self, name: str, fn: Callable[[Callable[[str], None]], None]) -> None:
        def progress(msg: str) -> None:
            self.current[name] = msg.strip()
            self.say(f"[background] {msg.strip()}")

        try:
            fn(progress)
            self.current[name] = "done"
        except Exception as exc:  # reported by wait(); the demo then falls back
            self.errors.append(f"{name}: {fallback_reason(exc)}")
            self.current[name] = "failed"

    @staticmethod
    def _binaries(progress: Callable[[str], None]) -> None:
        from neonvm.dev import binaries, realnode

        # kwok last: the foreground builds it after kube-apiserver unless this got there
        # first (the group's lock makes the later one find it built).
        for name in (*(g for g in realnode.GROUPS if g != "kubelet"), "kwok"):
            group = binaries.GROUPS[name]
            if not all(binaries.find(b) for b in group.binaries):
                progress(f"building {group.key} from the Go module proxy")
                progress(f"built {group.key} in {binaries.build(group, progress):.0f}s")
            if name == "cni-plugins":
                realnode.tiny_binary()

    @staticmethod
    def _image(progress: Callable[[str], None]) -> None:
        from neonvm.dev import images

        started = time.monotonic()
        images.build(("runner",), None, progress)
        progress(f"runner image ready after {time.monotonic() - started:.0f}s")

    def _tick(self, every: float) -> None:
        while not self._done.wait(every):
            busy = [f"{k}: {v}" for k, v in self.current.items() if v not in ("done", "failed")]
            if not busy and all(not t.is_alive() for t in self.threads):
                return
            minutes, seconds = divmod(int(time.monotonic() - self.begun), 60)
            self.say(f"[background] {minutes}m{seconds:02d}s, still working on: "
                     + ("; ".join(busy) or "starting"))

    def wait(self) -> str | None:
        """Wait for both; the first error (one line), or None."""
        for t in self.threads:
            t.join()
        self._done.set()
        return self.errors[0] if self.errors else None


def start_real_node(cluster: LocalCluster, prebuild: Prebuild | None = None) -> str | None:
    """Start the real node with the runner and guest images; None, or why not (a line).

    A node that fails half-way (e.g. its kubelet exits) is stopped and its Node object
    removed, so the fallback leaves nothing of it running and no pod lands on it.
    """
    from neonvm.dev import realguest, realnode

    problem = realguest.unavailable_reason()
    if problem:
        return problem
    if prebuild is not None:
        failed = prebuild.wait()
        if failed:
            return failed
    try:
        ready = realguest.prepare(cluster, _progress)
    except Exception as exc:  # any failure: fall back to the simulated nodes, say why
        why = fallback_reason(exc)
        _discard_real_node(cluster, realnode.node_name(0))
        return why
    _progress("real node ready (" + ", ".join(
        f"{k} {v:.0f}s" for k, v in ready.seconds.items()) + ")")
    return None


def _discard_real_node(cluster: LocalCluster, name: str) -> None:
    from neonvm.dev import realnode

    try:
        realnode.stop(cluster)
    except Exception as exc:  # still fall back; `neonvm dev down` tries again
        _progress(f"stopping the half-started real node failed: {fallback_reason(exc)}")
    api = kube.api_client(cluster.kubeconfig)
    try:
        client.CoreV1Api(api).delete_node(name)
    except client.ApiException as exc:
        if exc.status != 404:
            _progress(f"could not remove Node {name}: {exc.reason}")
    finally:
        api.close()


def _locks_reader(cluster: LocalCluster) -> Any:
    try:
        from neonvm.leader.etcd import Etcd
        from neonvm.leader.lock import LockTable
    except ImportError:
        return None
    config = cluster.locks_etcd_config()

    def read() -> list[dict[str, Any]]:
        etcd = Etcd(config)
        try:
            rows = []
            for info in LockTable(etcd, config.prefix).list():
                row = info.as_dict()
                rows.append({"key": f"{row.get('namespace')}/{row.get('name')}",
                             "holder": row.get("holder"), "epoch": row.get("epoch"),
                             "token": row.get("token")})
            return rows
        finally:
            etcd.close()

    return read


class Scenario:
    """The demo's story: the seed's pod deletion, then a leader kill, narrated as it goes.

    Each step waits for the system to settle before the next fault, so what the viewer
    sees is cause and effect. Steps advance from the status loop (no extra thread).
    """

    def __init__(self, cluster: LocalCluster, api: client.ApiClient, vm: str,
                 real: bool = False) -> None:
        self.cluster, self.api = cluster, api
        self.namespace, self.name = vm.split("/")
        self.real = real
        """Runner pods boot real guests: wait for Ready and show the guest's console."""
        self.log: list[str] = []
        self.step = 0
        self.mark = time.monotonic()
        self.created = time.monotonic()
        self.old_pod: str | None = None
        self.old_leader: str | None = None
        self.shown: set[str] = set()

    def _ready(self, pod: str | None) -> bool:
        """Without a real node every running pod counts; with it, only a Ready one (the
        runner reports Ready once the guest printed its marker)."""
        if not self.real:
            return True
        if not pod:
            return False
        try:
            status = client.CoreV1Api(self.api).read_namespaced_pod(pod, self.namespace).status
        except client.ApiException:
            return False
        return any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])

    def _show_console(self, pod: str, since: float, after: str) -> None:
        if pod in self.shown:
            return
        self.shown.add(pod)
        self.say(f"runner pod {pod} Ready {time.monotonic() - since:.1f}s after {after}; "
                 f"its guest's console (kubectl logs {pod} -c neonvm-runner):")
        try:
            text = client.CoreV1Api(self.api).read_namespaced_pod_log(
                pod, self.namespace, container="neonvm-runner")
        except client.ApiException as exc:
            self.say(f"  (log not readable: {exc.reason})")
            return
        lines = [ln for ln in text.splitlines()
                 if "neonvm-init:" in ln or "app: " in ln or "NEONVM_GUEST_READY" in ln]
        for line in lines[:12]:
            self.say(f"  | {line.strip()[:110]}")

    def say(self, msg: str) -> None:
        self.log.append(f"{time.strftime('%H:%M:%S')} {msg}")

    def advance(self, ov: overview.Overview) -> None:
        vm = next((v for v in ov.vms if (v.namespace, v.name) == (self.namespace, self.name)),
                  None)
        running = vm is not None and vm.phase == "Running" and vm.live_pods == 1
        elapsed = time.monotonic() - self.mark
        ready = running and vm is not None and self._ready(vm.pod)
        if self.step == 0 and ready and self.real and vm is not None and vm.pod:
            self._show_console(vm.pod, self.created, "the VM was applied")
        if self.step == 0 and ready and elapsed > 5 and vm is not None:
            self.old_pod = vm.pod
            self.say(f"deleting runner pod {vm.pod} (the bug report's scenario)")
            client.CoreV1Api(self.api).delete_namespaced_pod(vm.pod, self.namespace)
            self.step, self.mark = 1, time.monotonic()
        elif (self.step == 1 and running and vm is not None and vm.pod != self.old_pod
              and self._ready(vm.pod)):
            self.say(f"exactly one replacement, {vm.pod}, "
                     f"{'Ready (guest booted)' if self.real else 'running'} after "
                     f"{elapsed:.1f}s (restarts {vm.restarts})")
            if self.real and vm.pod:
                self._show_console(vm.pod, self.mark, "the old pod was deleted")
            self.step, self.mark = 2, time.monotonic()
        elif self.step == 2 and elapsed > 5 and ov.leader is not None and ov.leader.holder:
            self.old_leader = ov.leader.holder
            victim = self._process_of(ov.leader.holder)
            if victim is None:
                self.say(f"leader {ov.leader.holder} is not one of the demo's replicas")
                self.step = 4
                return
            self.say(f"SIGKILL to the leader {ov.leader.holder} ({victim})")
            self.cluster.stop_component(victim, sig=signal.SIGKILL)
            self.step, self.mark = 3, time.monotonic()
        elif (self.step == 3 and ov.leader is not None and ov.leader.holder
              and ov.leader.holder != self.old_leader):
            self.say(f"new leader {ov.leader.holder} (epoch {ov.leader.epoch}) after "
                     f"{elapsed:.1f}s; restarting the killed replica as a standby")
            self.step = 4
            start_replicas(self.cluster, len(list((self.cluster.state_dir / "run")
                                                  .glob("controller-*.pid"))) + 1)

    def _process_of(self, identity: str) -> str | None:
        for pid_file in (self.cluster.state_dir / "run").glob("controller-*.pid"):
            try:
                cmdline = Path(f"/proc/{int(pid_file.read_text())}/cmdline").read_bytes()
            except (OSError, ValueError):
                continue
            if identity.encode() in cmdline:
                return pid_file.stem
        return None


@click.group(invoke_without_command=True)
@STATE_DIR_OPTION
@click.option("--replicas", type=click.IntRange(1, 9), default=3, show_default=True)
@click.option("--nodes", type=click.IntRange(1, 50), default=3, show_default=True)
@click.option("--duration", type=click.FloatRange(1), default=None,
              help="Seconds to show the status view (default: until Ctrl-C).")
@click.option("--down", "stop_after", is_flag=True, help="Stop everything afterwards.")
@click.option("--scenario/--no-scenario", default=True, show_default=True,
              help="Delete the runner pod, then kill the leader, narrating what happens.")
@click.option("--real-node/--no-real-node", default=True, show_default=True,
              help="Run the VM's runner pod on a real kubelet node, booting a guest "
                   "(falls back to the simulated nodes, saying why, when it cannot start).")
@click.pass_context
def demo(ctx: click.Context, state_dir: Path | None, replicas: int, nodes: int,
         duration: float | None, stop_after: bool, scenario: bool, real_node: bool) -> None:
    """Local control plane + controller replicas + a sample VM + a live status view."""
    if ctx.invoked_subcommand is not None:
        return
    cluster = LocalCluster(state_dir)
    if not (cluster.state_dir / "cluster.json").exists() or cluster.spec.nodes != nodes:
        spec = cluster.spec if (cluster.state_dir / "cluster.json").exists() else ClusterSpec()
        spec.nodes = nodes
        cluster = LocalCluster(state_dir, spec)
    begun = time.monotonic()
    note = first_run_note(real_node)
    if note:
        click.echo(note, err=True)
    prebuild = None
    if real_node:
        from neonvm.dev import realguest

        if realguest.unavailable_reason() is None:
            prebuild = Prebuild(_progress)
    install_binaries(with_nodes=True)
    click.echo(f"1/5 local control plane in {cluster.state_dir}", err=True)
    cluster.up(progress=_progress)
    real = False
    if real_node:
        click.echo("2/5 real node (kubelet + containerd; guests boot under QEMU)", err=True)
        why_not = start_real_node(cluster, prebuild)
        real = why_not is None
        if why_not:
            click.echo(f"  real node: not started ({why_not}); runner pods run on the "
                       "simulated kwok nodes instead", err=True)
    else:
        click.echo("2/5 real node: off (--no-real-node); simulated kwok nodes only", err=True)
    click.echo(f"3/5 {replicas} controller replicas", err=True)
    start_replicas(cluster, replicas)
    api = kube.api_client(cluster.kubeconfig)
    if real:
        from neonvm.dev import realguest

        click.echo("4/5 a tiny VM whose runner pod boots a guest on the real node", err=True)
        vm = apply_real_vm(api)
        _progress(f"applied {vm}: 1 vCPU (250m requested), 128Mi, root disk image "
                  f"{realguest.DISK_IMAGE} running /app/report.sh")
    else:
        click.echo("4/5 sample VM", err=True)
        vm = apply_sample_vm(api)
        _progress(f"applied {vm} from {SAMPLE_VM.name}")
    click.echo(f"5/5 status (Ctrl-C to leave; everything keeps running); set up in "
               f"{time.monotonic() - begun:.0f}s", err=True)
    locks = _locks_reader(cluster)
    interactive = sys.stdout.isatty() and duration is None
    started = time.monotonic()
    checker = InvariantChecker(api, interval=0.2)
    story = Scenario(cluster, api, vm, real=real) if scenario else None
    with checker:
        try:
            while duration is None or time.monotonic() - started < duration:
                ov = overview.collect(api, LEASE_NAMESPACE, locks=locks)
                text = overview.render(ov)
                if story is not None:
                    story.advance(ov)
                    text += "\n\n" + "\n".join(story.log[-20:])
                if interactive:
                    click.clear()
                    click.echo(f"neonvm demo — {time.strftime('%H:%M:%S')}  "
                               f"(checker: {checker.report.samples} samples, "
                               f"{len(checker.report.strict)} violations)\n")
                    click.echo(text)
                    time.sleep(1.0)
                else:
                    click.echo(f"--- t={time.monotonic() - started:.0f}s")
                    click.echo(text)
                    time.sleep(3.0)
        except KeyboardInterrupt:
            pass
    report = checker.report
    click.echo(f"\ninvariant checker: {report.samples} pod lists, "
               f"{len(report.strict)} strict and {len(report.loose)} loose violations")
    api.close()
    if stop_after:
        click.echo(f"stopped: {', '.join(cluster.down())}")
    else:
        print_exports(cluster)
        click.echo("stop everything with: neonvm dev down")
    if not report.ok:
        raise SystemExit(1)


@demo.command("down")
@STATE_DIR_OPTION
def down(state_dir: Path | None) -> None:
    """Stop the demo: replicas and the local control plane."""
    stopped = LocalCluster(state_dir).down()
    click.echo(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
