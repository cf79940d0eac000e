"""The CLI's output is kubectl's: API objects and ``List``s for ``-o json|yaml``,
``-o jsonpath=``, ``--no-headers``, ``<none>``, "No resources found" on stderr,
``-l``, ``-w``, ``--request-timeout``, completion of VM names and contexts, and the
``kubectl neonvm`` plugin.

* pure: the jsonpath subset, kubectl's JSON and YAML printers, durations, usage errors;
* against the real API server (``tests/conftest.py``): ``vm list`` and ``vm get`` print
  exactly the objects the server holds; a watch streams changes and ends on Ctrl-C with
  exit 0; the plugin runs under the real ``kubectl`` when one is on ``PATH``.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.shell_completion import BashComplete
from click.testing import CliRunner, Result
from kubernetes import client

from neonvm import kube
from neonvm.api import types
from neonvm.cli import jsonpath, main
from neonvm.cli.kubeflags import Duration
from neonvm.cli.output import as_list, emit, kube_json, kube_yaml, without_managed_fields
from neonvm.dev.cluster import LocalCluster
from tests.support import wait_for
from tests.support.harness import create_vm, get_vm

ROOT = Path(__file__).resolve().parents[1]
NO_NODE = {"nodeSelector": {"none": "x"}}


def cli(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def render(template: str, doc: Any) -> str:
    return jsonpath.parse(template).render(doc)


# ---- jsonpath: the subset of kubectl's templates ------------------------------------------

LIST = as_list([
    {"metadata": {"name": "a", "labels": {"app.kubernetes.io/name": "db"}},
     "status": {"phase": "Running", "restartCount": 0}},
    {"metadata": {"name": "b", "labels": {}}, "status": {"phase": "Pending",
                                                          "restartCount": 2}},
])


@pytest.mark.unit
@pytest.mark.parametrize(("template", "expected"), [
    ("{.items[*].metadata.name}", "a b"),
    ("{.items[0].metadata.name}", "a"),
    ("{.items[-1].metadata.name}", "b"),
    ("{.items[0:1].metadata.name}", "a"),
    ("{.kind}/{.apiVersion}", "List/v1"),
    ("{range .items[*]}{.metadata.name}={.status.phase}{\"\\n\"}{end}",
     "a=Running\nb=Pending\n"),
    ("{range .items[*]}[{.metadata.name}]{end}", "[a][b]"),
    ('{.items[?(@.status.phase=="Running")].metadata.name}', "a"),
    ("{.items[?(@.status.restartCount>1)].metadata.name}", "b"),
    ("{.items[0].metadata.labels.app\\.kubernetes\\.io/name}", "db"),
    ("{.items[0].metadata.labels['app.kubernetes.io/name']}", "db"),
    ("{..phase}", "Running Pending"),
    ("{.items[0].status}", '{"phase":"Running","restartCount":0}'),
    ("{.items[1].status.restartCount}", "2"),
    ("{.items[*].status.missing}", ""),  # a missing field prints nothing, as kubectl
    ("{.metadata.resourceVersion}", ""),
    ("names: {.items[*].metadata.name}", "names: a b"),
])
def test_jsonpath_templates(template: str, expected: str) -> None:
    assert render(template, LIST) == expected


@pytest.mark.unit
@pytest.mark.parametrize("template", [
    "{.items[*]", "{range .items[*]}{.x}", "{end}", "{.items[x]}", "{len(.items)}",
])
def test_jsonpath_refuses_what_it_cannot_parse(template: str) -> None:
    with pytest.raises(jsonpath.JsonPathError):
        jsonpath.parse(template)


@pytest.mark.unit
def test_a_bad_output_format_or_template_is_a_usage_error_before_any_request() -> None:
    bad = cli("vm", "list", "-o", "jsonpath={.items[*]")
    assert bad.exit_code == 2 and "error parsing jsonpath" in bad.output
    unknown = cli("vm", "list", "-o", "custom-columns=X:.y")
    assert unknown.exit_code == 2 and "allowed formats are" in unknown.output
    timeout = cli("vm", "list", "--request-timeout", "soon")
    assert timeout.exit_code == 2 and "invalid duration" in timeout.output


# ---- kubectl's printers -----------------------------------------------------------------


@pytest.mark.unit
def test_json_and_yaml_are_printed_as_kubectl_prints_them() -> None:
    obj = {"metadata": {"name": "x", "annotations": {"note": "a<b & c>d " + "y" * 120}},
           "kind": "VirtualMachine", "apiVersion": "vm.neon.tech/v1"}
    text = kube_json(obj)
    # Sorted keys, 4-space indent, Go's HTML escaping inside strings.
    assert text.splitlines()[:3] == ['{', '    "apiVersion": "vm.neon.tech/v1",',
                                     '    "kind": "VirtualMachine",']
    assert "a\\u003cb \\u0026 c\\u003ed" in text and json.loads(text) == obj
    doc = kube_yaml(obj)
    assert doc.startswith("apiVersion: vm.neon.tech/v1\nkind: VirtualMachine\n")
    assert doc.endswith("\n") and yaml.safe_load(doc) == obj
    # A long string is folded at 80 columns, as go-yaml does.
    assert doc.splitlines()[3:5] == ["  annotations:", "    note: a<b & c>d " + "y" * 120]
    # go-yaml's string styles, as kubectl prints them.
    styled = kube_yaml({"status": "True", "time": "2026-12-05T01:08:29Z", "n": "1",
                        "msg": "a: b", "applied": '{"k":1}\n', "plain": "Running",
                        "list": ["no", 2]})
    assert styled.splitlines() == [
        "applied: |", '  {"k":1}', "list:", '- "no"', "- 2", "msg: 'a: b'", 'n: "1"',
        "plain: Running", 'status: "True"', 'time: "2026-12-05T01:08:29Z"']
    assert as_list([obj]) == {"apiVersion": "v1", "kind": "List", "items": [obj],
                              "metadata": {"resourceVersion": ""}}


@pytest.mark.unit
def test_tables_print_none_and_empty_listings_say_so_on_stderr(
        capsys: pytest.CaptureFixture[str]) -> None:
    emit([{"name": "a", "pod": None, "ready": ""}], "table", ["name", "pod", "ready"])
    out = capsys.readouterr()
    assert out.out.splitlines() == ["NAME   POD      READY", "a      <none>   <none>"]
    emit([{"name": "a", "pod": "p"}], "table", no_headers=True)
    assert capsys.readouterr().out.splitlines() == ["a   p"]
    emit([], "table", ["name"], namespace="team")
    out = capsys.readouterr()
    assert out.out == "" and out.err == "No resources found in team namespace.\n"
    emit([], "table", ["name"])
    assert capsys.readouterr().err == "No resources found\n"


@pytest.mark.unit
@pytest.mark.parametrize(("text", "seconds"), [
    ("0", None), ("5", 5.0), ("5s", 5.0), ("1m30s", 90.0), ("2h", 7200.0),
    ("250ms", 0.25), ("0s", None),
])
def test_request_timeout_takes_kubectls_durations(text: str, seconds: float | None) -> None:
    assert Duration().convert(text, None, None) == seconds


@pytest.mark.unit
def test_locks_dash_a_means_all_namespaces_and_excludes_n() -> None:
    both = cli("locks", "--endpoints", "http://127.0.0.1:1", "list", "-n", "x", "-A")
    assert both.exit_code == 2 and "exclude each other" in both.output
    helped = cli("locks", "list", "--help")
    assert "--all-installations" in helped.output
    assert "-A, --all-namespaces" in helped.output


@pytest.mark.unit
def test_non_object_commands_say_their_json_is_their_own_document() -> None:
    for command in (["status"], ["leader", "show"], ["locks", "list"], ["check"],
                    ["vm", "describe"], ["vm", "plan"]):
        text = " ".join(cli(*command, "--help").output.split())
        assert "own document, not a Kubernetes object" in text, command
    for command in (["vm", "list"], ["vm", "get"]):
        text = " ".join(cli(*command, "--help").output.split())
        assert "the API objects as kubectl prints them" in text, command


@pytest.mark.unit
def test_contexts_complete_from_the_kubeconfig(tmp_path: Path) -> None:
    kc = tmp_path / "kc.yaml"
    kc.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "dev",
        "clusters": [], "users": [],
        "contexts": [{"name": n, "context": {}} for n in ("dev", "prod-eu", "prod-us")]}))
    complete = BashComplete(main, {}, "neonvm", "_NEONVM_COMPLETE")
    found = complete.get_completions(["vm", "list", "--kubeconfig", str(kc), "--context"],
                                     "prod")
    assert [c.value for c in found] == ["prod-eu", "prod-us"]
    formats = complete.get_completions(["vm", "list", "-o"], "js")
    assert [c.value for c in formats] == ["json", "jsonpath="]


# ---- the kubectl plugin -----------------------------------------------------------------


@pytest.mark.unit
def test_the_package_installs_a_kubectl_plugin_entry_point() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kubectl-neonvm"] == "neonvm.cli:main"


def _plugin() -> Path:
    script = Path(sys.executable).with_name("kubectl-neonvm")
    if not script.exists():
        pytest.skip("the kubectl-neonvm entry point is not installed beside this Python "
                    "(pip install -e .)")
    return script


@pytest.mark.unit
def test_run_as_kubectl_neonvm_it_names_itself_so() -> None:
    helped = subprocess.run([str(_plugin()), "vm", "--help"], capture_output=True,
                            text=True, timeout=60)
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("Usage: kubectl neonvm vm ")


def _kubectl() -> str | None:
    found = shutil.which("kubectl")
    if found:
        return found
    cache = Path.home() / ".cache" / "neonvm" / "bin"
    return next((str(p) for p in sorted(cache.glob("*/kubectl")) if os.access(p, os.X_OK)),
                None)


# ---- against the real API server --------------------------------------------------------


def _labelled(api: client.ApiClient, namespace: str, name: str, **labels: str
              ) -> dict[str, Any]:
    create_vm(api, namespace, name, spec=NO_NODE)
    if labels:
        client.CustomObjectsApi(api).patch_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, name,
            {"metadata": {"labels": labels}})
    vm = get_vm(api, namespace, name)
    assert vm is not None
    return vm


@pytest.mark.cluster
def test_vm_list_json_is_a_list_of_the_objects_and_get_yaml_is_the_object(
        cluster: LocalCluster, api: client.ApiClient, namespace: str) -> None:
    kc = str(cluster.kubeconfig)
    alpha = _labelled(api, namespace, "alpha", tier="db")
    beta = _labelled(api, namespace, "beta")
    listed = cli("vm", "list", "-n", namespace, "--kubeconfig", kc, "-o", "json")
    assert listed.exit_code == 0, listed.output
    doc = json.loads(listed.stdout)
    assert {k: v for k, v in doc.items() if k != "items"} == {
        "apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""}}
    # What the server holds, without managedFields (as kubectl) unless asked for.
    assert doc["items"] == [without_managed_fields(alpha), without_managed_fields(beta)]
    assert "managedFields" in alpha["metadata"]
    assert listed.stdout == kube_json(doc) + "\n"
    full = cli("vm", "list", "-n", namespace, "--kubeconfig", kc, "-o", "json",
               "--show-managed-fields")
    assert json.loads(full.stdout)["items"] == [alpha, beta]

    got = cli("vm", "get", "alpha", "-n", namespace, "--kubeconfig", kc, "-o", "yaml")
    assert got.exit_code == 0, got.output
    assert yaml.safe_load(got.stdout) == without_managed_fields(alpha)
    assert got.stdout == kube_yaml(without_managed_fields(alpha))
    both = cli("vm", "get", "alpha", "beta", "-n", namespace, "--kubeconfig", kc, "-o",
               "json")
    assert [i["metadata"]["name"] for i in json.loads(both.stdout)["items"]] == \
        ["alpha", "beta"]

    names = cli("vm", "list", "-n", namespace, "--kubeconfig", kc, "-o",
                "jsonpath={.items[*].metadata.name}")
    assert names.exit_code == 0 and names.stdout == "alpha beta"
    selected = cli("vm", "list", "-n", namespace, "--kubeconfig", kc, "-l", "tier=db",
                   "-o", "name")
    assert selected.stdout.split() == ["virtualmachine.vm.neon.tech/alpha"]
    not_db = cli("vm", "list", "-n", namespace, "--kubeconfig", kc, "-l", "tier!=db",
                 "-o", "name")
    assert not_db.stdout.split() == ["virtualmachine.vm.neon.tech/beta"]


@pytest.mark.cluster
def test_vm_tables_are_kubectls(cluster: LocalCluster, api: client.ApiClient,
                                namespace: str) -> None:
    kc = str(cluster.kubeconfig)
    empty = cli("vm", "list", "-n", namespace, "--kubeconfig", kc)
    assert empty.exit_code == 0
    assert empty.stdout == ""
    assert empty.stderr == f"No resources found in {namespace} namespace.\n"
    _labelled(api, namespace, "alpha")
    table = cli("vm", "list", "-n", namespace, "--kubeconfig", kc)
    header, row = table.stdout.splitlines()
    assert header.split()[:3] == ["NAME", "PHASE", "PODNAME"]  # no NAMESPACE without -A
    assert row.split()[:3] == ["alpha", "<none>", "<none>"]  # no status written yet
    bare = cli("vm", "list", "-n", namespace, "--kubeconfig", kc, "--no-headers")
    (only,) = bare.stdout.splitlines()  # the row alone (its widths need no header room)
    assert only.split()[:-1] == row.split()[:-1]  # all but AGE, which may have ticked
    every = cli("vm", "list", "-A", "--kubeconfig", kc, "-l", "nothing=here")
    assert every.exit_code == 0 and every.stderr == "No resources found\n"
    wide = cli("vm", "get", "alpha", "-n", namespace, "--kubeconfig", kc, "-o", "wide")
    assert wide.stdout.splitlines()[0].split()[-3:] == ["NODE", "PODIP", "IMAGE"]

    missing = cli("vm", "get", "alpha", "gamma", "-n", namespace, "--kubeconfig", kc,
                  "-o", "name")
    assert missing.exit_code == 1
    assert missing.stdout == "virtualmachine.vm.neon.tech/alpha\n"
    assert missing.stderr == ('Error from server (NotFound): '
                              'virtualmachines.vm.neon.tech "gamma" not found\n')


@pytest.mark.cluster
def test_vm_names_and_namespaces_complete_from_the_cluster(
        cluster: LocalCluster, api: client.ApiClient, namespace: str) -> None:
    for name in ("alpha", "alps", "beta"):
        create_vm(api, namespace, name, spec=NO_NODE)
    complete = BashComplete(main, {}, "neonvm", "_NEONVM_COMPLETE")
    args = ["vm", "get", "--kubeconfig", str(cluster.kubeconfig), "-n", namespace]
    assert [c.value for c in complete.get_completions(args, "al")] == ["alpha", "alps"]
    assert [c.value for c in complete.get_completions([*args, "alpha"], "al")] == ["alps"]
    spaces = complete.get_completions(["vm", "list", "--kubeconfig",
                                       str(cluster.kubeconfig), "-n"], namespace[:6])
    assert namespace in [c.value for c in spaces]


@pytest.fixture
def black_hole() -> Iterator[str]:
    """A server that accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"https://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.unit
def test_request_timeout_gives_up_on_a_server_that_never_answers(
        black_hole: str, tmp_path: Path) -> None:
    kc = tmp_path / "kc.yaml"
    kc.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": black_hole,
                                               "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    for command in (["vm", "list"], ["vm", "get", "x"], ["leader", "show"], ["status"]):
        result = cli(*command, "--kubeconfig", str(kc), "--request-timeout", "250ms")
        assert result.exit_code == 3, (command, result.output)
        assert "timed out" in result.output, (command, result.output)


class Streamed:
    """A CLI process whose stdout is read line by line on a thread."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, stdin=subprocess.DEVNULL)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        assert self.proc.stdout is not None
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))

    def wait_line(self, wanted: Any, what: str) -> str:
        def found() -> str | None:
            while not self.lines.empty():
                self.seen.append(self.lines.get())
            return next((line for line in self.seen if wanted(line)), None)
        line = wait_for(found, 60, interval=0.1, what=f"{what}; saw {self.seen}")
        assert line is not None
        self.seen.remove(line)
        return line

    def interrupt(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGINT)
        try:
            code = self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        assert self.proc.stderr is not None
        return code, self.proc.stderr.read()


@pytest.mark.cluster
def test_vm_list_watch_streams_changes_until_ctrl_c(
        cluster: LocalCluster, api: client.ApiClient, namespace: str) -> None:
    create_vm(api, namespace, "alpha", spec=NO_NODE)
    watch = Streamed([sys.executable, "-m", "neonvm", "vm", "list", "-w",
                      "--output-watch-events", "-n", namespace,
                      "--kubeconfig", str(cluster.kubeconfig)])
    try:
        header = watch.wait_line(lambda s: s.startswith("EVENT"), "the header")
        assert header.split()[:3] == ["EVENT", "NAME", "PHASE"]
        watch.wait_line(lambda s: s.split()[:2] == ["ADDED", "alpha"], "alpha at the start")
        create_vm(api, namespace, "beta", spec=NO_NODE)
        watch.wait_line(lambda s: s.split()[:2] == ["ADDED", "beta"], "beta added")
        client.CustomObjectsApi(api).patch_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, "alpha",
            {"metadata": {"labels": {"touched": "yes"}}})
        watch.wait_line(lambda s: s.split()[:2] == ["MODIFIED", "alpha"], "alpha modified")
        kube.request(api, "DELETE", f"/apis/{types.GROUP}/{types.VERSION}/namespaces/"
                     f"{namespace}/{types.PLURAL}/beta")
        deleted = watch.wait_line(lambda s: s.split()[:2] == ["DELETED", "beta"],
                                  "beta deleted")
        assert deleted.index("beta") == header.index("NAME")  # the columns stay aligned
    finally:
        code, err = watch.interrupt()
    assert code == 0 and "Traceback" not in err, err


@pytest.mark.cluster
def test_vm_get_watch_prints_each_version_of_the_object_as_json(
        cluster: LocalCluster, api: client.ApiClient, namespace: str) -> None:
    create_vm(api, namespace, "alpha", spec=NO_NODE)
    create_vm(api, namespace, "other", spec=NO_NODE)
    watch = Streamed([sys.executable, "-m", "neonvm", "vm", "get", "alpha", "-w",
                      "-o", "jsonpath={.metadata.name} {.metadata.labels.step}{\"\\n\"}",
                      "-n", namespace, "--kubeconfig", str(cluster.kubeconfig)])
    try:
        watch.wait_line(lambda s: s == "alpha ", "alpha at the start")
        for step in ("1", "2"):
            for name in ("other", "alpha"):
                client.CustomObjectsApi(api).patch_namespaced_custom_object(
                    types.GROUP, types.VERSION, namespace, types.PLURAL, name,
                    {"metadata": {"labels": {"step": step}}})
            watch.wait_line(lambda s, step=step: s == f"alpha {step}", f"step {step}")
        assert not any(s.startswith("other") for s in watch.seen), watch.seen
    finally:
        code, err = watch.interrupt()
    assert code == 0 and "Traceback" not in err, err


@pytest.mark.cluster
def test_kubectl_runs_it_as_a_plugin(cluster: LocalCluster, api: client.ApiClient,
                                     namespace: str) -> None:
    plugin = _plugin()
    kubectl = _kubectl()
    if kubectl is None:
        pytest.skip("no kubectl on PATH or under ~/.cache/neonvm/bin")
    _labelled(api, namespace, "alpha", tier="db")
    client.CustomObjectsApi(api).patch_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, "alpha",
        {"metadata": {"annotations": {"multi": "line one\nline two\n",
                                      "long": "a: b " * 40,  # a line kubectl folds
                                      "when": "2026-12-05T01:08:29Z", "flag": "True"}}})
    env = {**os.environ, "PATH": f"{plugin.parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "KUBECONFIG": str(cluster.kubeconfig)}

    def run(*argv: str) -> str:
        done = subprocess.run([kubectl, *argv, "-n", namespace], env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (argv, done.stderr)
        return done.stdout

    # Byte for byte what kubectl itself prints for the same objects.
    resource = f"{types.PLURAL}.{types.GROUP}"
    assert run("neonvm", "vm", "get", "alpha", "-o", "yaml") == \
        run("get", resource, "alpha", "-o", "yaml")
    assert run("neonvm", "vm", "list", "-o", "json") == run("get", resource, "-o", "json")
    assert run("neonvm", "vm", "list", "-o", "yaml") == run("get", resource, "-o", "yaml")
    template = "jsonpath={.items[*].metadata.name}"
    assert run("neonvm", "vm", "list", "-o", template) == "alpha"
    assert run("get", resource, "-o", template) == "alpha"
