"""``neonvm vm list|get|describe|plan`` and ``neonvm controller run``'s argument handling.

``list`` and ``get`` print the API objects (their kubectl shape: tests/test_cli_output.py);
``describe`` and ``plan`` print what the controller recorded and would do.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from kubernetes import client

from neonvm import kube
from neonvm.cli import main
from neonvm.controller.leader_endpoint import endpoint_ip_problem
from neonvm.dev.cluster import LocalCluster
from tests.support import shipped_reconciler
from tests.support.authority import StaticAuthority
from tests.support.harness import create_vm


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


@pytest.mark.cluster
def test_vm_plan_list_and_get_show_the_plan_the_pod_and_the_fence(
        cluster: LocalCluster, api: client.ApiClient, namespace: str) -> None:
    kc = str(cluster.kubeconfig)
    created = create_vm(api, namespace, "shown", spec={"nodeSelector": {"none": "x"}})
    code, out = run("vm", "plan", "shown", "-n", namespace, "--kubeconfig", kc, "-o", "json")
    assert code == 0 and json.loads(out)["action"] == "AddFinalizer"

    controller = kube.api_client(cluster.kubeconfig_for("controller"))
    try:
        shipped_reconciler(controller).reconcile(
            f"{namespace}/shown", StaticAuthority(epoch=2, token=9), direct_first=True)
    finally:
        controller.close()
    pod = f"shown-{created['metadata']['uid'][:8]}-1"

    code, out = run("vm", "list", "-n", namespace, "--kubeconfig", kc, "-o", "json")
    assert code == 0
    (obj,) = json.loads(out)["items"]
    status = obj["status"]
    assert (obj["metadata"]["name"], status["podName"], status.get("pendingPod"),
            status.get("restartCount", 0), status["fence"]) \
        == ("shown", pod, None, 0, {"epoch": 2, "token": 9})

    code, out = run("vm", "describe", "shown", "-n", namespace, "--kubeconfig", kc,
                    "-o", "yaml")
    info = yaml.safe_load(out)
    assert code == 0 and [p["name"] for p in info["pods"]] == [pod]
    assert info["pods"][0]["gated"] is False and info["pods"][0]["fence"] == "2/9"
    assert {c["type"] for c in info["conditions"]} >= {"Available"}

    code, out = run("vm", "list", "-n", namespace, "--kubeconfig", kc)
    assert code == 0 and "PODNAME" in out and pod in out and "2/9" in out
    code, out = run("vm", "describe", "shown", "-n", namespace, "--kubeconfig", kc)
    assert code == 0 and pod in out and "Available" in out

    code, out = run("vm", "plan", "shown", "-n", namespace, "--kubeconfig", kc, "-o", "json")
    assert code == 0 and json.loads(out)["action"] == "Done"


@pytest.mark.cluster
def test_vm_get_of_a_missing_vm_is_a_one_line_error(
        cluster: LocalCluster, namespace: str) -> None:
    code, out = run("vm", "get", "nope", "-n", namespace, "--kubeconfig", str(cluster.kubeconfig))
    assert code == 1 and out.strip().splitlines() == [
        'Error from server (NotFound): virtualmachines.vm.neon.tech "nope" not found']
    code, out = run("vm", "describe", "nope", "-n", namespace,
                    "--kubeconfig", str(cluster.kubeconfig))
    assert code == 1 and out.strip().splitlines() == [f"Error: VirtualMachine {namespace}/nope "
                                                      f"not found"]


def unreachable_kubeconfig(tmp_path: Path) -> Path:
    """A kubeconfig whose API server is a closed port (127.0.0.1:9)."""
    kubeconfig = tmp_path / "kc"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:9"}}],
        "users": [{"name": "u", "user": {}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    return kubeconfig


@pytest.mark.unit
def test_an_unreachable_api_server_is_a_one_line_error(tmp_path: Path) -> None:
    kubeconfig = unreachable_kubeconfig(tmp_path)
    code, out = run("vm", "list", "--kubeconfig", str(kubeconfig))
    assert code == 3  # cannot reach the cluster
    assert len(out.strip().splitlines()) == 1 and "unreachable" in out


@pytest.mark.unit
def test_controller_run_refuses_bad_fault_specs_and_election_timings() -> None:
    code, out = run("controller", "run", "--fault", "crash_after=lunch")
    assert code == 2 and "step must be one of" in out
    code, out = run("controller", "run", "--lease-duration", "2", "--renew-deadline", "3")
    assert code == 2 and "must be greater than renew_deadline" in out


@pytest.mark.unit
def test_controller_run_refuses_a_rights_endpoint_ip_an_endpointslice_may_not_name(
        tmp_path: Path) -> None:
    # The API server refuses such an EndpointSlice (422): the replica would run, and its
    # runners, never reaching a leader, would kill their guests. It fails at start instead.
    kubeconfig = unreachable_kubeconfig(tmp_path)
    for ip, why in (("127.0.0.1", "loopback"), ("0.0.0.0", "unspecified"),
                    ("169.254.0.7", "link-local"), ("::1", "loopback"), ("pod", "not an IP")):
        code, out = run("controller", "run", "--kubeconfig", str(kubeconfig),
                        "--rights-bind", "127.0.0.1:0", "--rights-service", "ops/rights",
                        "--pod-ip", ip)
        assert code == 2 and why in out and "--pod-ip" in out, (ip, out)
    assert endpoint_ip_problem("10.244.1.7") is None
    assert endpoint_ip_problem("fd00::7") is None
