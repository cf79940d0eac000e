"""A vm-builder-layout guest on the real node: the controller's runner pod boots it,
its ENTRYPOINT runs, vector's :9100 and vm-monitor's :10301 answer at the pod's IP.

Opt-in (``NEONVM_TEST_REAL_NODE=1 pytest tests/test_real_node_vmbuilder.py -s``), like
the other real-node tests beyond the default one. One ``neonvm controller run`` replica
and one VirtualMachine written the way NeonVM's e2e VMs are (no ``kernelImage``; a
``rootDisk`` container image holding ``/disk.qcow2``; ``args`` without ``command``;
``ports`` naming ``host-metrics`` 9100 and ``monitor`` 10301; an emptyDisk, a tmpfs and
a ConfigMap disk).
The root disk is :mod:`neonvm.dev.vmbuilderdisk`'s, in vm-builder's layout, so the
runner boots its ``/neonvm/bin/init`` with the runtime disk (docs/runner.md, "The
vm-builder boot contract"). The host then does what NeonVM's autoscaler-agent does:
an HTTP GET to the pod's IP on 9100 (``/metrics``) and 10301. Deleting the VM powers the
guest off through its inittab's shutdown, and the ENTRYPOINT gets its SIGTERM. Times are
printed, not asserted.
"""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from neonvm.dev import realnode, vmbuilderdisk
from neonvm.dev.cluster import LocalCluster
from tests.support import replica_group, wait_for
from tests.support.harness import create_vm, delete_vm, get_vm, runner_pods
from tests.support.real_node import _images_skip_reason, _print_pods_and_events

VM = "vmb"
MARK = vmbuilderdisk.ENTRYPOINT_MARKER

SPEC: dict[str, Any] = {
    "nodeSelector": {realnode.REAL_LABEL: "true"},
    "terminationGracePeriodSeconds": 60,
    "guest": {
        # One vCPU, 250m requested (the real node has this host's 2 CPUs), as NeonVM's
        # e2e VMs ask for a fraction.
        "cpus": {"min": "250m", "max": 1, "use": "250m"},
        "memorySlotSize": "256Mi", "memorySlots": {"min": 1, "max": 1, "use": 1},
        "rootDisk": {"image": vmbuilderdisk.DISK_IMAGE, "imagePullPolicy": "Never",
                     "size": "64Mi"},
        "args": ["from-args", "two words"],
        "env": [{"name": "GREETING", "value": "hello from the spec"}],
        "settings": {"sysctl": ["vm.swappiness = 17"]},
        "ports": [{"name": "host-metrics", "port": vmbuilderdisk.VECTOR_PORT},
                  {"name": "monitor", "port": vmbuilderdisk.MONITOR_PORT}],
    },
    "disks": [{"name": "data", "mountPath": "/data", "emptyDisk": {"size": "16Mi"}},
              {"name": "scratch", "mountPath": "/scratch", "tmpfs": {"size": "8Mi"}},
              {"name": "vmconfig", "mountPath": "/config",
               "configMap": {"name": "vmb-config",
                             "items": [{"key": "app.conf", "path": "app.conf"}]}}],
}
CONFIG = "listen_addresses = '*'"


def http_get(url: str) -> tuple[int, str] | None:
    """(status, body) of a GET, or None while nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except (OSError, ValueError):
        return None


def ready_pod(api: client.ApiClient, namespace: str) -> Any | None:
    """The VM's one runner pod once it is Ready and has an IP, else None."""
    pods = runner_pods(api, namespace, VM)
    if len(pods) != 1:
        return None
    pod = pods[0]
    if pod.status.phase in ("Succeeded", "Failed"):
        raise AssertionError(client.CoreV1Api(api).read_namespaced_pod_log(
            pod.metadata.name, namespace, container="neonvm-runner")[-5000:])
    ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
    return pod if ready and pod.status.pod_ip else None


@pytest.mark.cluster
@pytest.mark.realnode
@pytest.mark.slow
@pytest.mark.timeout(1800)  # a cold runner image build takes most of the default 600 s
@pytest.mark.skipif(_images_skip_reason() is not None, reason=_images_skip_reason() or "")
def test_a_vmbuilder_guest_on_the_real_node_runs_its_entrypoint_and_serves_9100_and_10301(
    cluster: LocalCluster, api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    from neonvm.dev import guestdisk, realguest

    problem = realguest.unavailable_reason()
    if problem:
        pytest.skip(f"no real guest here: {problem}")
    node = realguest.prepare(cluster, print).node
    core = client.CoreV1Api(api)
    try:
        _raw, qcow2 = vmbuilderdisk.build_disk(tmp_path / "disk")
        archive = guestdisk.disk_image_archive(qcow2, tmp_path / "vmbuilder.oci.tar",
                                               vmbuilderdisk.DISK_IMAGE)
        node.ctr("images", "import", "--platform", "linux/amd64", str(archive), timeout=300)
        with replica_group(cluster, api, namespace, tmp_path / "replicas") as group:
            group.start("c0")
            created = time.monotonic()
            core.create_namespaced_config_map(namespace, {
                "metadata": {"name": "vmb-config"}, "data": {"app.conf": CONFIG}})
            create_vm(api, namespace, VM, restart_policy="Always", spec=SPEC)
            try:
                pod: Any = wait_for(lambda: ready_pod(api, namespace), timeout=600, interval=0.5,
                               what="the runner pod Ready on the real node")
                figures = [f"runner pod Ready {time.monotonic() - created:.1f} s after the VM "
                           "was created"]
                assert pod.spec.node_name == node.name
                # The named ports a Service's targetPort finds (NeonVM's sample Service).
                [runner] = [c for c in pod.spec.containers if c.name == "neonvm-runner"]
                declared = {(p.name, p.container_port) for p in runner.ports}
                assert {("host-metrics", vmbuilderdisk.VECTOR_PORT),
                        ("monitor", vmbuilderdisk.MONITOR_PORT)} <= declared, declared
                name, ip = pod.metadata.name, pod.status.pod_ip

                def log() -> str:
                    return str(core.read_namespaced_pod_log(name, namespace,
                                                            container="neonvm-runner"))

                # The image's ENTRYPOINT ran, with the spec's args in place of its CMD.
                wait_for(lambda: f"{MARK} report done" in log(), timeout=300, interval=1,
                         what="the ENTRYPOINT's report on the console")
                figures.append(f"ENTRYPOINT's report in the pod's log "
                               f"{time.monotonic() - created:.1f} s after create")
                text = log()
                for line in ("boot: runner kernel", "/neonvm/bin/init with a runtime disk",
                             "vminit: runtime disk: args.sh env.sh mounts.sh sysctl.conf",
                             f"{MARK} argv: from-args two words",
                             f"{MARK} GREETING=hello from the spec BAKED=from-the-image",
                             f"{MARK} swappiness 17",
                             f"{MARK} mount /scratch tmpfs rw",
                             f"{MARK} mount /data ext4 rw",
                             f"{MARK} mount /config ext4 ro",
                             f"{MARK} file /config/app.conf: {CONFIG}"):
                    assert line in text, text[-5000:]
                assert "baked-cmd" not in text
                root_kb = int(text.split(f"{MARK} root-kb ")[1].split()[0])
                assert root_kb > 40 * 1024, root_kb  # the 32 MiB image grown to 64 MiB

                # What the autoscaler-agent reads, from the pod's network: the host
                # reaches the pod's IP through the node's bridge.
                metrics_url = f"http://{ip}:{vmbuilderdisk.VECTOR_PORT}/metrics"
                monitor_url = f"http://{ip}:{vmbuilderdisk.MONITOR_PORT}/monitor"
                wait_for(lambda: (http_get(metrics_url) or (0, ""))[0] == 200, timeout=120,
                         interval=1, what=f"GET {metrics_url}")
                metrics = http_get(metrics_url) or (0, "")
                assert metrics[0] == 200 and "host_load1{" in metrics[1], metrics
                assert "host_memory_available_bytes{" in metrics[1], metrics
                available = next(float(line.split()[-1]) for line in metrics[1].splitlines()
                                 if line.startswith("host_memory_available_bytes{"))
                assert 0 < available < 256 << 20, metrics[1]  # the guest's, not the host's
                monitor = wait_for(lambda: http_get(monitor_url), timeout=120, interval=1,
                                   what=f"GET {monitor_url}")
                assert monitor == (200, "vm-monitor stand-in\n"), monitor
                figures.append(f":9100 and :10301 answer at {ip} "
                               f"{time.monotonic() - created:.1f} s after create")
                status = (get_vm(api, namespace, VM) or {}).get("status") or {}
                assert status.get("phase") == "Running", status
                assert status.get("podIP") == ip, status
                print("\n".join(["", "vm-builder guest on the real node:", *figures,
                                 f"GET {metrics_url} -> 200:",
                                 *metrics[1].splitlines()[:5],
                                 f"GET {monitor_url} -> {monitor}",
                                 *[line for line in text.splitlines()
                                   if MARK in line or "vminit" in line or "boot:" in line]]))

                # Deleting the VM: SIGTERM to the runner, the power button, the inittab's
                # shutdown, the ENTRYPOINT's trap, QEMU exits 0.
                stream = core.read_namespaced_pod_log(name, namespace,
                                                      container="neonvm-runner",
                                                      follow=True, _preload_content=False)
                followed: list[bytes] = []
                reader = threading.Thread(target=lambda: followed.extend(stream.stream()),
                                          daemon=True)
                reader.start()
                delete_vm(api, namespace, VM)
                wait_for(lambda: not runner_pods(api, namespace, VM), timeout=180,
                         interval=0.5, what="the runner pod gone")
                reader.join(timeout=60)
                tail = b"".join(followed).decode(errors="replace")
                for line in ("SIGTERM received: powering the guest down",
                             f"{MARK} SIGTERM", "QEMU exited with code 0"):
                    assert line in tail, tail[-4000:]
            finally:
                with contextlib.suppress(Exception):
                    delete_vm(api, namespace, VM)
                    wait_for(lambda: not runner_pods(api, namespace, VM), timeout=180,
                             interval=0.5, what="the runner pod gone")
    finally:
        _print_pods_and_events(cluster, namespace)
        node.stop()
        # The session's other tests must not get pods bound to the stopped node.
        with contextlib.suppress(client.ApiException):
            core.delete_node(node.name)
