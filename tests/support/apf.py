"""Which FlowSchema, and so which priority level, the API server's Priority and Fairness
filter picks for a request: the matching rules of flowcontrol.apiserver.k8s.io/v1 over
given schemas (pure logic, for the chart's objects beside the server's built-in ones;
tests/test_chart_priority.py checks the real server's answers too). See
docs/leader-election.md, "What the shorter defaults cost"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Request:
    """One request as APF sees it: a resource request (``resource`` set; ``namespace``
    None when cluster-scoped) or a non-resource one (``path`` set)."""

    user: str
    groups: tuple[str, ...]
    verb: str
    api_group: str = ""
    resource: str = ""
    namespace: str | None = None
    path: str = ""


def service_account(namespace: str, name: str) -> tuple[str, tuple[str, ...]]:
    """The user and groups the API server authenticates a ServiceAccount token as."""
    return (f"system:serviceaccount:{namespace}:{name}",
            ("system:serviceaccounts", f"system:serviceaccounts:{namespace}",
             "system:authenticated"))


def _subject(subject: dict[str, Any], req: Request) -> bool:
    if subject["kind"] == "User":
        return subject["user"]["name"] in ("*", req.user)
    if subject["kind"] == "Group":
        return subject["group"]["name"] == "*" or subject["group"]["name"] in req.groups
    sa = subject["serviceAccount"]
    prefix = f"system:serviceaccount:{sa['namespace']}:"
    return req.user.startswith(prefix) and sa["name"] in ("*", req.user[len(prefix):])


def _has(values: list[str] | None, value: str) -> bool:
    return bool(values) and ("*" in values or value in values)  # type: ignore[operator]


def _resource_rule(rule: dict[str, Any], req: Request) -> bool:
    if not (_has(rule.get("verbs"), req.verb) and _has(rule.get("apiGroups"), req.api_group)
            and _has(rule.get("resources"), req.resource)):
        return False
    if req.namespace is None:
        return bool(rule.get("clusterScope"))
    return _has(rule.get("namespaces"), req.namespace)


def _url(pattern: str, path: str) -> bool:
    if pattern == "*" or pattern == path:
        return True
    return pattern.endswith("/*") and (path == pattern[:-2]
                                       or path.startswith(pattern[:-1]))


def _non_resource_rule(rule: dict[str, Any], req: Request) -> bool:
    return (_has(rule.get("verbs"), req.verb)
            and any(_url(p, req.path) for p in rule.get("nonResourceURLs") or []))


def matches(schema: dict[str, Any], req: Request) -> bool:
    """Whether some rule of ``schema`` matches ``req``: one of its subjects, and one of its
    resource rules (a resource request) or non-resource rules (a path)."""
    for rule in schema["spec"].get("rules") or []:
        if not any(_subject(s, req) for s in rule["subjects"]):
            continue
        if req.resource and any(_resource_rule(r, req) for r in rule.get("resourceRules") or []):
            return True
        if req.path and any(_non_resource_rule(r, req)
                            for r in rule.get("nonResourceRules") or []):
            return True
    return False


def classify(schemas: list[dict[str, Any]], req: Request) -> str:
    """The priority level of the first schema matching ``req``, in the API server's order:
    lowest matchingPrecedence first, ties by name."""
    for schema in sorted(schemas, key=lambda s: (s["spec"]["matchingPrecedence"],
                                                 s["metadata"]["name"])):
        if matches(schema, req):
            name: str = schema["spec"]["priorityLevelConfiguration"]["name"]
            return name
    raise AssertionError(f"no schema matches {req}")
