"""The CLI behaves as kubectl users expect, and the newcomer's path works.

* which kubeconfig, context and default namespace a command uses (``--kubeconfig``,
  ``$KUBECONFIG`` as a colon-separated list, ``~/.kube/config``, in-cluster; ``--context``;
  ``-n`` from the context): unit tests on temporary kubeconfig files with ``HOME``
  pointing at a temporary directory, and the same through ``neonvm vm list`` against the
  real API server;
* exit codes: 1 a violation, 2 usage, 3 the cluster cannot be reached, 4 no verdict;
* ``-o name`` and ``-o wide``; shell completion (the rest of kubectl's output habits:
  tests/test_cli_output.py);
* ``neonvm dev up`` / ``eval "$(neonvm dev env)"`` / ``neonvm controller run``: the Lease's
  namespace exists, the replica runs as the controller identity, and a VM reaches Running
  on a simulated node with no 403 from the admission fence.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result
from kubernetes import client

from neonvm import kube
from neonvm.api import types
from neonvm.cli import main
from neonvm.dev import nodes
from neonvm.dev.cluster import CONTROLLER_USER, LocalCluster
from neonvm.leader.election import DEFAULT_NAMESPACE as LEASE_NAMESPACE
from tests.support import wait_for
from tests.support.harness import create_vm, get_vm, is_gated, runner_pods

UNREACHABLE = "https://127.0.0.1:1"


def kubeconfig(path: Path, contexts: dict[str, tuple[str, str | None]],
               current: str | None) -> Path:
    """A kubeconfig with one cluster per context: ``{context: (server, namespace)}``."""
    doc: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": f"c-{n}", "cluster": {"server": server}}
                     for n, (server, _) in contexts.items()],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": n, "context": {"cluster": f"c-{n}", "user": "u",
                                             **({"namespace": ns} if ns else {})}}
                     for n, (_, ns) in contexts.items()],
    }
    if current is not None:
        doc["current-context"] = current
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HOME and no $KUBECONFIG."""
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return h


def host_of(kubeconfig_path: Path | None = None, context: str | None = None) -> str:
    api = kube.api_client(kubeconfig_path, context) if context else \
        kube.api_client(kubeconfig_path)
    try:
        return str(api.configuration.host)
    finally:
        api.close()


# ---- which kubeconfig, context, namespace (no servers) ----------------------------------


@pytest.mark.unit
def test_without_flag_or_env_the_home_kube_config_is_used(home: Path) -> None:
    kubeconfig(home / ".kube" / "config", {"home": ("https://home.example:6443", "team")},
               "home")
    assert host_of() == "https://home.example:6443"
    source = kube.resolve()
    assert source.files == (home / ".kube" / "config",)
    assert (source.context, source.namespace) == ("home", "team")


@pytest.mark.unit
def test_flag_beats_env_and_env_beats_home(home: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    kubeconfig(home / ".kube" / "config", {"home": ("https://home.example", None)}, "home")
    env_file = kubeconfig(tmp_path / "env.yaml", {"env": ("https://env.example", None)}, "env")
    flag_file = kubeconfig(tmp_path / "flag.yaml", {"flag": ("https://flag.example", None)},
                           "flag")
    monkeypatch.setenv("KUBECONFIG", str(env_file))
    assert host_of() == "https://env.example"
    assert host_of(flag_file) == "https://flag.example"


@pytest.mark.unit
def test_kubeconfig_env_is_a_list_missing_files_skipped_first_current_context_wins(
        home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = kubeconfig(tmp_path / "a.yaml", {"a": ("https://a.example", "ns-a")}, "a")
    second = kubeconfig(tmp_path / "b.yaml", {"b": ("https://b.example", "ns-b")}, "b")
    missing = tmp_path / "missing.yaml"
    monkeypatch.setenv("KUBECONFIG", os.pathsep.join([str(missing), str(first), str(second)]))
    source = kube.resolve()
    assert source.files == (first, second)
    assert (source.context, source.namespace) == ("a", "ns-a")
    assert host_of() == "https://a.example"
    # A context of the second file is reachable with --context.
    assert host_of(context="b") == "https://b.example"
    assert kube.default_namespace(context="b") == "ns-b"

    monkeypatch.setenv("KUBECONFIG", str(missing))
    with pytest.raises(kube.KubeconfigError, match="names no existing file"):
        kube.resolve()


@pytest.mark.unit
def test_context_picks_server_and_namespace_unknown_context_is_an_error(
        home: Path) -> None:
    path = kubeconfig(home / ".kube" / "config", {
        "dev": ("https://dev.example", "dev-ns"),
        "prod": ("https://prod.example", None),
    }, "dev")
    assert host_of() == "https://dev.example"
    assert kube.default_namespace() == "dev-ns"
    assert host_of(context="prod") == "https://prod.example"
    assert kube.default_namespace(context="prod") == "default"
    with pytest.raises(kube.KubeconfigError, match="context 'nope' not found") as err:
        kube.api_client(path, "nope")
    assert "dev, prod" in str(err.value)


@pytest.mark.unit
def test_in_cluster_namespace_comes_from_the_service_account(home: Path,
                                                             tmp_path: Path) -> None:
    ns_file = tmp_path / "namespace"
    ns_file.write_text("tenant-7\n")
    source = kube.resolve(environ={"HOME": str(home)}, namespace_file=ns_file)
    assert source.in_cluster and source.namespace == "tenant-7"
    assert kube.resolve(environ={"HOME": str(home)},
                        namespace_file=tmp_path / "absent").namespace == "default"
    with pytest.raises(kube.KubeconfigError, match="no kubeconfig"):
        kube.api_client()  # not in a pod: one clear line instead of a service-host error


@pytest.mark.unit
def test_cli_exit_codes_without_a_cluster(home: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    nothing = runner.invoke(main, ["vm", "list"])
    assert nothing.exit_code == 3 and "no kubeconfig" in nothing.output
    path = kubeconfig(tmp_path / "kc.yaml", {"x": (UNREACHABLE, None)}, "x")
    unknown = runner.invoke(main, ["check", "--kubeconfig", str(path), "--context", "y"])
    assert unknown.exit_code == 3 and "context 'y' not found" in unknown.output
    usage = runner.invoke(main, ["check", "--no-such-flag"])
    assert usage.exit_code == 2
    usage = runner.invoke(main, ["vm", "list", "-o", "nope"])
    assert usage.exit_code == 2


@pytest.mark.unit
def test_the_completion_script_is_produced_and_completes_subcommands() -> None:
    script = Path(sys.executable).with_name("neonvm")
    if not script.exists():
        pytest.skip("the neonvm entry point is not installed beside this Python")
    env = {**os.environ, "_NEONVM_COMPLETE": "bash_source"}
    source = subprocess.run([str(script)], env=env, capture_output=True, text=True,
                            timeout=60)
    assert source.returncode == 0, source.stderr
    assert "_neonvm_completion()" in source.stdout
    assert "complete -o nosort -F _neonvm_completion neonvm" in source.stdout
    zsh = subprocess.run([str(script)], env={**os.environ, "_NEONVM_COMPLETE": "zsh_source"},
                         capture_output=True, text=True, timeout=60)
    assert zsh.returncode == 0 and "#compdef neonvm" in zsh.stdout
    # What the bash function asks for when the user types `neonvm vm l<TAB>`.
    complete = subprocess.run(
        [str(script)], capture_output=True, text=True, timeout=60,
        env={**os.environ, "_NEONVM_COMPLETE": "bash_complete",
             "COMP_WORDS": "neonvm vm l", "COMP_CWORD": "2"})
    assert complete.returncode == 0, complete.stderr
    assert complete.stdout.split() == ["plain,list"]


# ---- against the real API server --------------------------------------------------------


def cli(*args: str, env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env)


def admin_kubeconfig_in(cluster: LocalCluster, path: Path, namespace: str | None) -> Path:
    """The admin kubeconfig, copied to ``path`` with ``namespace`` in its context."""
    doc = yaml.safe_load(cluster.kubeconfig.read_text())
    if namespace is not None:
        doc["contexts"][0]["context"]["namespace"] = namespace
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.cluster
def test_vm_list_uses_home_kube_config_and_its_context_namespace(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    create_vm(api, namespace, "found", spec={"nodeSelector": {"none": "x"}})
    home = tmp_path / "home"
    admin_kubeconfig_in(cluster, home / ".kube" / "config", namespace)
    env: dict[str, str | None] = {"HOME": str(home), "KUBECONFIG": None}
    listed = cli("vm", "list", "-o", "name", env=env)
    assert listed.exit_code == 0, listed.output
    assert listed.output.split() == ["virtualmachine.vm.neon.tech/found"]
    got = cli("vm", "get", "found", "-o", "json", env=env)
    assert got.exit_code == 0, got.output
    # --context on the command line, and -n overriding the context's namespace.
    other = cli("vm", "list", "--context", "neonvm-dev", "-n", "kube-system", "-o", "name",
                env=env)
    assert other.exit_code == 0 and other.output.strip() == "", other.output


@pytest.mark.cluster
def test_vm_list_and_get_name_and_wide(cluster: LocalCluster, api: client.ApiClient,
                                       namespace: str) -> None:
    kc = str(cluster.kubeconfig)
    create_vm(api, namespace, "alpha", spec={"nodeSelector": {"none": "x"}})
    create_vm(api, namespace, "beta", spec={
        "nodeSelector": {"none": "x"},
        "guest": {"cpus": {"min": 1, "max": 1, "use": 1},
                  "memorySlots": {"min": 1, "max": 1, "use": 1},
                  "memorySlotSize": "256Mi",
                  "rootDisk": {"image": "wide-image:1", "size": "1Gi"}}})
    names = cli("vm", "list", "-n", namespace, "--kubeconfig", kc, "-o", "name")
    assert names.exit_code == 0, names.output
    # kubectl's name printer: the kind in lower case, then the group (not the singular).
    kind = types.KIND.lower()
    assert sorted(names.output.split()) == [f"{kind}.{types.GROUP}/alpha",
                                            f"{kind}.{types.GROUP}/beta"]
    one = cli("vm", "get", "beta", "-n", namespace, "--kubeconfig", kc, "-o", "name")
    assert one.exit_code == 0 and one.output.strip() == "virtualmachine.vm.neon.tech/beta"
    missing = cli("vm", "get", "gamma", "-n", namespace, "--kubeconfig", kc, "-o", "name")
    assert missing.exit_code == 1 and "not found" in missing.output

    wide = cli("vm", "list", "-n", namespace, "--kubeconfig", kc, "-o", "wide")
    assert wide.exit_code == 0, wide.output
    header, *rows = wide.output.splitlines()
    assert header.split()[-3:] == ["NODE", "PODIP", "IMAGE"]
    beta = next(r for r in rows if r.split()[0] == "beta")  # NAMESPACE only with -A
    assert beta.split()[-1] == "wide-image:1"
    narrow = cli("vm", "list", "-n", namespace, "--kubeconfig", kc)
    assert "IMAGE" not in narrow.output.splitlines()[0]


@pytest.mark.cluster
def test_check_and_status_exit_3_when_unreachable_1_on_a_violation_4_when_forbidden(
        cluster: LocalCluster, api: client.ApiClient, controller_api: client.ApiClient,
        namespace: str, tmp_path: Path) -> None:
    unreachable = tmp_path / "unreachable.kubeconfig"
    doc = yaml.safe_load(cluster.kubeconfig.read_text())
    doc["clusters"][0]["cluster"]["server"] = UNREACHABLE
    unreachable.write_text(yaml.safe_dump(doc))
    for command in (["check", "-n", namespace], ["status"], ["vm", "list", "-n", namespace],
                    ["leader", "show"]):
        result = cli(*command, "--kubeconfig", str(unreachable))
        assert result.exit_code == 3, (command, result.output)
        assert result.output.startswith("error: API server unreachable"), result.output
        assert result.output.strip().count("\n") == 0

    kc = str(cluster.kubeconfig)
    assert cli("check", "-n", namespace, "--kubeconfig", kc).exit_code == 0
    # The scheduler's identity may list pods but not VirtualMachines: no verdict.
    forbidden = cli("check", "-n", namespace,
                    "--kubeconfig", str(cluster.kubeconfig_for("scheduler")))
    assert forbidden.exit_code == 4, forbidden.output
    assert "403" in forbidden.output and "no verdict" in forbidden.output

    # Two ungated runner pods of one VM: a violation for both commands.
    vm = create_vm(api, namespace, "twin", spec={"nodeSelector": {"none": "x"}})
    as_controller = client.CoreV1Api(controller_api)
    for name in ("twin-a", "twin-b"):
        as_controller.create_namespaced_pod(namespace, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {
                types.LABEL_VM_NAME: "twin", types.LABEL_VM_UID: vm["metadata"]["uid"]}},
            "spec": {"schedulingGates": [{"name": types.SCHEDULING_GATE}],
                     "nodeSelector": {"none": "x"}, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "runner", "image": "neonvm-runner:dev"}]}})
        as_controller.patch_namespaced_pod(
            name, namespace, [{"op": "remove", "path": "/spec/schedulingGates/0"}])
    violated = cli("check", "-n", namespace, "--kubeconfig", kc)
    assert violated.exit_code == 1 and "VIOLATED" in violated.output, violated.output
    status = cli("status", "--kubeconfig", kc, "-o", "json")
    assert status.exit_code == 1, status.output


@pytest.mark.cluster
def test_leader_show_name(cluster: LocalCluster, api: client.ApiClient,
                          namespace: str) -> None:
    client.CoordinationV1Api(api).create_namespaced_lease(namespace, {
        "metadata": {"name": "shown"}, "spec": {"holderIdentity": "someone",
                                                "leaseDurationSeconds": 15}})
    shown = cli("leader", "show", "-n", namespace, "--name", "shown",
                "--kubeconfig", str(cluster.kubeconfig), "-o", "name")
    assert shown.exit_code == 0, shown.output
    assert shown.output.strip() == "lease.coordination.k8s.io/shown"


@pytest.mark.cluster
def test_dev_node_list_name(cluster: LocalCluster) -> None:
    listed = cli("dev", "node", "list", "--state-dir", str(cluster.state_dir), "-o", "name")
    assert listed.exit_code == 0, listed.output
    assert sorted(listed.output.split()) == sorted(f"node/{nodes.node_name(i)}"
                                                   for i in range(cluster.spec.nodes))


# ---- the newcomer's path ----------------------------------------------------------------


def dev_env(cluster: LocalCluster) -> dict[str, str]:
    """What ``eval "$(neonvm dev env)"`` sets, parsed from the command's real output."""
    result = subprocess.run(
        [sys.executable, "-m", "neonvm", "dev", "env", "--state-dir", str(cluster.state_dir)],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    exported: dict[str, str] = {}
    for line in result.stdout.splitlines():
        words = shlex.split(line)
        assert words[0] == "export" and len(words) == 2, line
        key, _, value = words[1].partition("=")
        exported[key] = value
    return exported


@pytest.mark.cluster
def test_dev_cluster_has_the_lease_namespace_and_dev_env_exports_the_controller_identity(
        cluster: LocalCluster, api: client.ApiClient) -> None:
    assert client.CoreV1Api(api).read_namespace(LEASE_NAMESPACE).metadata.name \
        == LEASE_NAMESPACE
    exported = dev_env(cluster)
    assert exported["KUBECONFIG"] == str(cluster.kubeconfig)
    assert exported["NEONVM_CONTROLLER_RUN_KUBECONFIG"] \
        == str(cluster.kubeconfig_for("controller"))
    # Whoever uses that file is the identity the admission fence lets ungate.
    as_controller = kube.api_client(exported["NEONVM_CONTROLLER_RUN_KUBECONFIG"])
    try:
        review = client.AuthenticationV1Api(as_controller).create_self_subject_review(
            client.V1SelfSubjectReview())
    finally:
        as_controller.close()
    assert review.status.user_info.username == CONTROLLER_USER


@pytest.mark.nodes
@pytest.mark.cluster
def test_newcomer_sequence_runs_a_vm_on_a_simulated_node_without_a_403(
        cluster: LocalCluster, api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    if cluster.spec.nodes < 1:
        pytest.skip("needs NEONVM_TEST_NODES >= 1 (scheduler, controller-manager, kwok)")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NEONVM_", "KUBECONFIG"))}
    env.update(dev_env(cluster))  # eval "$(neonvm dev env)"
    # `neonvm controller run` with its defaults: no --kubeconfig, the default Lease
    # namespace. Only what keeps this test apart from others sharing the cluster differs:
    # a free health port, its own Lease name and etcd prefix (under /neonvm/, the only
    # prefix the dev env's etcd certificate may touch), one watched namespace.
    lease_name = f"newcomer-{uuid.uuid4().hex[:6]}"
    log_path = tmp_path / "replica.log"
    argv = [sys.executable, "-m", "neonvm", "controller", "run",
            "--health-port", "0", "--health-host", "127.0.0.1",
            "--lease-name", lease_name, "--etcd-prefix",
            f"/neonvm/t-{uuid.uuid4().hex[:8]}",
            "--watch-namespace", namespace]
    with log_path.open("wb") as log:
        replica = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        lease = wait_for(lambda: _lease_holder(api, lease_name), 60,
                         what=f"the replica to lead {LEASE_NAMESPACE}/{lease_name}")
        assert lease
        create_vm(api, namespace, "first")

        def running() -> str | None:
            vm = get_vm(api, namespace, "first") or {}
            status = vm.get("status") or {}
            pods = runner_pods(api, namespace, "first")
            if status.get("phase") != "Running" or len(pods) != 1 or is_gated(pods[0]):
                return None
            pod = pods[0]
            return pod.spec.node_name if pod.status.phase == "Running" else None

        node = wait_for(running, 120, interval=0.5, what="VM first Running on a kwok node")
        assert node in {nodes.node_name(i) for i in range(cluster.spec.nodes)}
        text = log_path.read_text(errors="replace")
        # A status code, not a time: "23:55:25.403 INFO" once matched a bare \b403\b.
        for refusal in (r"(?<![.:\d])\b403\b", "Forbidden", "only the neonvm controller",
                        r"(?<![.:\d])\b404\b", "Not Found"):
            assert not re.search(refusal, text), (refusal, text[-4000:])
    finally:
        replica.terminate()
        try:
            replica.wait(30)
        except subprocess.TimeoutExpired:
            replica.kill()
            replica.wait(30)
        print(log_path.read_text(errors="replace")[-20000:])


def _lease_holder(api: client.ApiClient, name: str) -> str | None:
    try:
        lease = client.CoordinationV1Api(api).read_namespaced_lease(name, LEASE_NAMESPACE)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
    holder: str | None = lease.spec.holder_identity
    return holder
