"""A small runner of kuttl's semantics, to run NeonVM's e2e suite (its kuttl tests) here.

kuttl (github.com/kudobuilder/kuttl) is not served by the Go module proxy this project
can reach, so it cannot be built; this module does what its ``kubectl kuttl test`` does
with the files NeonVM's suite uses (read from kuttl's ``internal/step``, ``internal/file``
and ``internal/utils``). docs/neonvm-compat.md, "NeonVM's e2e suite", says what it covers.

- A test is a directory; its steps are the files ``NN-<name>.yaml`` grouped by ``NN``
  (a file without an index, such as a README, is ignored), run in index order.
- A step: delete the objects its ``TestStep.delete`` names and wait until they are gone;
  run its ``TestStep.commands`` (``sh -c`` for a script; ``$NAMESPACE``, ``$KUBECONFIG``
  set, in the test's directory); create each object of its apply files and of
  ``TestStep.apply`` paths, or, if it exists, send it as a JSON merge patch carrying the
  existing resourceVersion (kuttl's CreateOrUpdate); then, once a second until the
  step's timeout (the ``TestAssert``'s, else the suite's), check every object of
  ``NN-assert.yaml``, the assert's commands, and that no object of ``NN-errors.yaml``
  matches.
- An object matches when the expected one is a subset of it: maps may have more keys,
  lists must have the same length with every item a subset, scalars equal with the same
  JSON type (kuttl's ``IsSubset``). With a name it is read; without one, the objects of
  its kind with its labels are listed and one of them must match.
- Kinds are found by discovery, case-insensitively (``kind: pod`` is a Pod).
- A test stops at its first failing step.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from neonvm import kube

KUTTL_GROUP = "kuttl.dev"
FILE_NAME = re.compile(r"^(\d+-)?([^-.]+)(-[^.]+)?((?:\.gotmpl)?\.yaml)?$")
"""kuttl's test file name pattern (``internal/file/name.go``)."""


class _KubectlLoader(yaml.SafeLoader):
    """YAML as kubectl and kuttl read it: a timestamp stays a string."""


_KubectlLoader.yaml_implicit_resolvers = {
    key: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def load_documents(path: Path) -> list[dict[str, Any]]:
    """The non-empty YAML documents of ``path``."""
    return [d for d in yaml.load_all(path.read_text(), Loader=_KubectlLoader) if d]


@dataclass
class Step:
    """One step of a kuttl test: what its files say."""

    index: int
    name: str = ""
    apply: list[dict[str, Any]] = field(default_factory=list)
    asserts: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    test_step: dict[str, Any] = field(default_factory=dict)
    test_assert: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepResult:
    """A step's outcome: passed, or the reason it failed."""

    index: int
    name: str
    passed: bool
    reason: str = ""

    @property
    def label(self) -> str:
        return f"{self.index:02d}-{self.name}"


def _is_kuttl(obj: dict[str, Any], kind: str) -> bool:
    return str(obj.get("apiVersion", "")).startswith(KUTTL_GROUP + "/") and obj.get(
        "kind") == kind


def _objects_from_path(path: str, base: Path) -> list[dict[str, Any]]:
    target = Path(path) if os.path.isabs(path) else base / path
    files = sorted(target.glob("*.yaml")) if target.is_dir() else [target]
    return [obj for f in files for obj in load_documents(f)]


def load_test(directory: Path) -> list[Step]:
    """The steps of the kuttl test in ``directory``, in index order."""
    steps: dict[int, Step] = {}
    for entry in sorted(directory.iterdir()):
        match = FILE_NAME.match(entry.name)
        if match is None or match.group(1) is None:
            continue
        index = int(match.group(1)[:-1])
        step = steps.setdefault(index, Step(index=index))
        files = sorted(entry.iterdir()) if entry.is_dir() else [entry]
        kind = match.group(2).lower()
        for f in files:
            objects = load_documents(f)
            if kind == "assert":
                for obj in objects:
                    if _is_kuttl(obj, "TestAssert"):
                        step.test_assert = obj  # kuttl keeps the last one
                    else:
                        step.asserts.append(obj)
            elif kind == "errors":
                step.errors.extend(objects)
            else:
                step.name = step.name or match.group(2) + (match.group(3) or "")
                for obj in objects:
                    if _is_kuttl(obj, "TestStep"):
                        step.test_step = obj
                    else:
                        step.apply.append(obj)
    for step in steps.values():
        ts = step.test_step
        step.name = ts.get("name") or step.name or "assert"
        for path in ts.get("apply") or []:
            step.apply.extend(_objects_from_path(os.path.expandvars(path), directory))
        for path in ts.get("assert") or []:
            step.asserts.extend(_objects_from_path(os.path.expandvars(path), directory))
        for path in ts.get("error") or []:
            step.errors.extend(_objects_from_path(os.path.expandvars(path), directory))
    return [steps[i] for i in sorted(steps)]


def is_subset(expected: Any, actual: Any) -> str | None:
    """None when ``expected`` is a subset of ``actual`` (kuttl's IsSubset), else the first
    difference."""
    found = differences(expected, actual)
    return found[0] if found else None


def differences(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Every place where ``expected`` is not a subset of ``actual`` (kuttl's IsSubset
    stops at the first)."""
    where = path or "."
    if _json_type(expected) != _json_type(actual):
        return [f"{where}: type mismatch: {expected!r} != {actual!r}"]
    if isinstance(expected, list):
        if len(expected) != len(actual):
            types = [a.get("type") for a in actual if isinstance(a, dict) and "type" in a]
            extra = f" (actual types {types})" if types else ""
            return [f"{where}: slice length mismatch: {len(expected)} != {len(actual)}{extra}"]
        return [d for i, (e, a) in enumerate(zip(expected, actual, strict=True))
                for d in differences(e, a, f"{path}[{i}]")]
    if isinstance(expected, dict):
        return [d for key, value in expected.items()
                for d in ([f"{path}.{key}: key is missing from map"] if key not in actual
                          else differences(value, actual[key], f"{path}.{key}"))]
    if expected == actual:
        return []
    return [f"{where}: value mismatch, expected: {expected!r} != actual: {actual!r}"]


def _json_type(value: Any) -> str:
    """The Go type an unstructured object gives ``value`` (int64 and float64 differ)."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, float) and value.is_integer():
        return "int"
    return type(value).__name__


@dataclass(frozen=True)
class Resource:
    """Where the objects of one kind live in the REST API."""

    prefix: str
    plural: str
    namespaced: bool

    def collection(self, namespace: str) -> str:
        if self.namespaced:
            return f"{self.prefix}/namespaces/{namespace}/{self.plural}"
        return f"{self.prefix}/{self.plural}"


class Runner:
    """Runs kuttl tests against the cluster ``api`` talks to (``kubeconfig`` for commands).

    ``suite_timeout`` is the TestSuite's ``timeout`` (NeonVM's: 600 s), every step's
    timeout unless its TestAssert names one.
    """

    def __init__(self, api: client.ApiClient, kubeconfig: Path, suite_timeout: int = 600,
                 log: Callable[[str], None] = print) -> None:
        self.api = api
        self.kubeconfig = kubeconfig
        self.suite_timeout = suite_timeout
        self.log = log
        self._resources: dict[tuple[str, str], Resource] = {}

    # ---- discovery -------------------------------------------------------------------------

    def resource(self, obj: dict[str, Any]) -> Resource:
        api_version, kind = obj["apiVersion"], obj["kind"]
        key = (api_version, kind.lower())
        if key not in self._resources:
            prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            listing = kube.request(self.api, "GET", prefix)
            for r in listing.get("resources", []):
                if "/" not in r["name"] and r["kind"].lower() == kind.lower():
                    self._resources[key] = Resource(prefix, r["name"], r["namespaced"])
                    break
            else:
                raise LookupError(f"no resource of kind {kind} in {api_version}")
        return self._resources[key]

    def _path(self, obj: dict[str, Any], namespace: str) -> tuple[Resource, str]:
        res = self.resource(obj)
        ns = (obj.get("metadata") or {}).get("namespace") or namespace
        return res, res.collection(ns)

    # ---- the parts of a step ---------------------------------------------------------------

    def create_or_update(self, obj: dict[str, Any], namespace: str, deadline: float) -> str:
        _, collection = self._path(obj, namespace)
        name = obj["metadata"]["name"]
        while True:
            try:
                actual = kube.get_or_none(self.api, f"{collection}/{kube.path_segment(name)}")
                if actual is None:
                    kube.request(self.api, "POST", collection, obj)
                    return "created"
                patch = {**obj, "metadata": {**obj["metadata"], "resourceVersion":
                                             actual["metadata"]["resourceVersion"]}}
                kube.request(self.api, "PATCH", f"{collection}/{kube.path_segment(name)}",
                             patch, content_type="application/merge-patch+json")
                return "updated"
            except client.ApiException as exc:
                if exc.status not in (409,) or time.monotonic() > deadline:
                    raise

    def delete_and_wait(self, ref: dict[str, Any], namespace: str, deadline: float) -> None:
        _, collection = self._path(ref, namespace)
        if ref.get("name"):
            names = [ref["name"]]
        else:
            selector = ",".join(f"{k}={v}" for k, v in (ref.get("labels") or {}).items())
            items = kube.request(self.api, "GET", collection,
                                 query=[("labelSelector", selector)] if selector else None)
            names = [i["metadata"]["name"] for i in items.get("items", [])]
        for name in names:
            try:
                kube.request(self.api, "DELETE", f"{collection}/{kube.path_segment(name)}")
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
        for name in names:
            while kube.get_or_none(self.api, f"{collection}/{kube.path_segment(name)}"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{ref.get('kind')} {name} not deleted in time")
                time.sleep(0.5)

    def run_command(self, command: dict[str, Any], namespace: str, cwd: Path,
                    timeout: float) -> str | None:
        """None when the command succeeded (or may fail), else why it failed."""
        env = {**os.environ, "NAMESPACE": namespace, "KUBECONFIG": str(self.kubeconfig),
               "PATH": f"{cwd}/bin/:{os.environ.get('PATH', '')}"}
        if command.get("script"):
            argv = ["sh", "-c", command["script"]]
        else:
            argv = shlex.split(os.path.expandvars(command["command"]))
            if command.get("namespaced"):
                argv += ["--namespace", namespace]
        if command.get("timeout"):
            timeout = float(command["timeout"])
        try:
            done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=max(timeout, 1.0), check=False)
        except subprocess.TimeoutExpired:
            return f"command exceeded {timeout:.0f} s: {argv[-1][:80]!r}"
        if done.returncode == 0 or command.get("ignoreFailure"):
            return None
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return f"command failed (exit {done.returncode}): {' | '.join(tail)}"

    def check_object(self, expected: dict[str, Any], namespace: str) -> str | None:
        """None when an object matches ``expected``, else why none does."""
        res, collection = self._path(expected, namespace)
        meta = expected.get("metadata") or {}
        if meta.get("name"):
            actual = kube.get_or_none(self.api, f"{collection}/{kube.path_segment(meta['name'])}")
            if actual is None:
                return f"{expected['kind']} {meta['name']}: not found"
            actuals = [actual]
        else:
            selector = ",".join(f"{k}={v}" for k, v in (meta.get("labels") or {}).items())
            actuals = kube.request(self.api, "GET", collection,
                                   query=[("labelSelector", selector)] if selector else None
                                   ).get("items", [])
            if not actuals:
                return f"no {expected['kind']} matched labels {meta.get('labels')}"
        whys = []
        for actual in actuals:
            actual.setdefault("apiVersion", expected["apiVersion"])
            actual.setdefault("kind", expected["kind"])
            found = differences(_for_compare(expected, actual), actual)
            if not found:
                return None
            whys.append("; ".join(found))
        ident = meta.get("name") or f"labels {meta.get('labels')}"
        return f"{res.plural} {ident}: {whys[0]}"

    def check_absent(self, expected: dict[str, Any], namespace: str) -> str | None:
        meta = expected.get("metadata") or {}
        return None if self.check_object(expected, namespace) else (
            f"{expected['kind']} {meta.get('name') or meta.get('labels')} matched an errors file")

    def check(self, step: Step, namespace: str, cwd: Path, remaining: float) -> list[str]:
        whys = [w for obj in step.asserts if (w := self.check_object(obj, namespace))]
        for command in step.test_assert.get("commands") or []:
            why = self.run_command(command, namespace, cwd, remaining)
            if why:
                whys.append(why)
        whys += [w for obj in step.errors if (w := self.check_absent(obj, namespace))]
        return whys

    # ---- a step, a test --------------------------------------------------------------------

    def timeout_of(self, step: Step) -> int:
        return int(step.test_assert.get("timeout") or self.suite_timeout)

    def run_step(self, step: Step, namespace: str, cwd: Path) -> StepResult:
        def failed(reason: str) -> StepResult:
            self.log(f"    {step.index:02d}-{step.name}: FAILED: {reason}")
            return StepResult(step.index, step.name, False, reason)

        start = time.monotonic()
        apply_deadline = start + self.suite_timeout
        try:
            for ref in step.test_step.get("delete") or []:
                self.delete_and_wait(ref, namespace, apply_deadline)
            for command in step.test_step.get("commands") or []:
                why = self.run_command(command, namespace, cwd, self.suite_timeout)
                if why:
                    return failed(why)
            for obj in step.apply:
                self.create_or_update(obj, namespace, apply_deadline)
        except (client.ApiException, LookupError, TimeoutError) as exc:
            text = kube.api_error_message(exc) if isinstance(exc, client.ApiException) else str(exc)
            return failed(f"applying: {text[:300]}")
        timeout = self.timeout_of(step)
        first: list[str] = []
        last: list[str] = []
        while True:
            elapsed = time.monotonic() - start
            try:
                whys = self.check(step, namespace, cwd, max(timeout - elapsed, 1))
            except (client.ApiException, LookupError) as exc:
                whys = [str(exc)[:300]]
            if not whys:
                self.log(f"    {step.index:02d}-{step.name}: passed "
                         f"({time.monotonic() - start:.1f} s)")
                return StepResult(step.index, step.name, True)
            if whys != last:
                self.log(f"    {step.index:02d}-{step.name}: at {elapsed:.1f} s: "
                         + "; ".join(whys)[:400])
                last = whys
            first = first or whys
            if time.monotonic() - start >= timeout:
                # The last attempt may have been cut short by the step's end: say the first too.
                said = "; ".join(whys)
                if first != whys:
                    said += " (first attempt: " + "; ".join(first) + ")"
                return failed(f"after {timeout} s: {said}")
            time.sleep(1.0)

    def run_test(self, directory: Path, namespace: str,
                 last_step: int | None = None) -> Iterator[StepResult]:
        """Runs the test's steps (up to ``last_step``), stopping after the first failure."""
        self.log(f"=== {directory.name} (namespace {namespace})")
        for step in load_test(directory):
            if last_step is not None and step.index > last_step:
                return
            result = self.run_step(step, namespace, directory)
            yield result
            if not result.passed:
                return


def _for_compare(expected: dict[str, Any], actual: dict[str, Any]) -> dict[str, Any]:
    """``expected`` with the apiVersion/kind spelled as the server answers (``pod``: Pod)."""
    out = dict(expected)
    if str(expected.get("kind", "")).lower() == str(actual.get("kind", "")).lower():
        out["kind"] = actual["kind"]
    return out
