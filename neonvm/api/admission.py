"""CPU amounts written as numbers (``cpus: {min: 0.25}``), stored as NeonVM stores them.

NeonVM's manifests write vCPUs as YAML floats. NeonVM's own mutating webhook decodes the
object and writes it back, so ``0.25`` is stored as ``"250m"``. A CRD schema cannot
accept a float beside a string: ``anyOf`` with types other than integer and string is not
structural, and an untyped field is invisible to CEL. So this package ships a
MutatingAdmissionPolicy (in the API server, CEL, no webhook server) that rewrites a JSON
number in ``spec.guest.cpus.{min,max,use}`` into NeonVM's encoding before the schema is
checked: a whole number of vCPUs as an integer, anything else as ``"<n>m"``, rounded up
to the next millicpu as NeonVM's parser does. Without the policy (an API server before
Kubernetes 1.36, or one without the ``admissionregistration.k8s.io/v1`` policy API) a
float is refused with a 422; strings and integers work either way
(docs/neonvm-compat.md, "CPU amounts").
"""

from __future__ import annotations

from typing import Any

from neonvm.api import types

POLICY_NAME = "neonvm-cpu-amounts"
CPU_BOUNDS = ("min", "max", "use")


def _millicpu_of(value: str) -> str:
    """CEL: the millicpu of the double ``value``, rounded to a micro-vCPU first (so 1.1
    is 1100m, not 1101m from 1100.0000000000002) and then up to a whole millicpu."""
    micro = f"int({value} * 1000000.0 + 0.5)"
    return f"(({micro} + 999) / 1000)"


def _neonvm_json(value: str) -> str:
    """CEL: ``value`` (a double) as NeonVM's MilliCPU JSON: an int or ``"<n>m"``."""
    milli = _millicpu_of(value)
    return f"({milli} % 1000 == 0 ? dyn({milli} / 1000) : dyn(string({milli}) + 'm'))"


def rewrite_expression() -> str:
    """The policy's JSONPatch expression: one ``replace`` per number in ``cpus``."""
    parts = []
    for bound in CPU_BOUNDS:
        field = f"object.spec.guest.cpus.{bound}"
        parts.append(
            f"(has({field}) && type({field}) == double ? [JSONPatch{{op: 'replace', "
            f"path: '/spec/guest/cpus/{bound}', value: {_neonvm_json(field)}}}] : [])")
    return " + ".join(parts)


def cpu_amounts_policy(name: str = POLICY_NAME) -> dict[str, Any]:
    """The MutatingAdmissionPolicy (apply it with :func:`cpu_amounts_binding`)."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingAdmissionPolicy",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "neonvm"}},
        "spec": {
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [types.GROUP], "apiVersions": [types.VERSION],
                "operations": ["CREATE", "UPDATE"], "resources": [types.PLURAL]}]},
            "matchConditions": [{
                "name": "has-cpus",
                "expression": "has(object.spec) && has(object.spec.guest) && "
                              "has(object.spec.guest.cpus)"}],
            "failurePolicy": "Fail",
            "reinvocationPolicy": "IfNeeded",
            "mutations": [{"patchType": "JSONPatch",
                           "jsonPatch": {"expression": rewrite_expression()}}],
        },
    }


def cpu_amounts_binding(name: str = POLICY_NAME) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingAdmissionPolicyBinding",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "neonvm"}},
        "spec": {"policyName": name},
    }
