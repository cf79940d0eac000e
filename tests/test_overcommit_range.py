"""``spec.overcommit`` factors are numbers from 0.001 to 10, enforced by the real API server
(neonvm/api/types.py, ``OvercommitSettings``; docs/security.md, "Autoscaling labels and
annotations on runner pods").

The factors reach the runner pod's ``vm.neon.tech/overcommit`` annotation, by which NeonVM's
scheduler plugin divides the VM's usage: a VM writer must not make its VM count as nothing,
as a negative amount, or as a division by zero there. NeonVM's own CRD takes any quantity.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from neonvm.api import types
from tests.support.api import sample_vm

BAD = ["0", "-1", "0m", "0.0001", "10001m", "11", "1e3", "1E", 1000000000, -2]
GOOD = ["0.001", "1m", "0.5", 1, "1.5", "1250m", "10", "1e1"]


def create(api: client.ApiClient, namespace: str, name: str, overcommit: dict[str, Any],
           dry_run: bool = True) -> dict[str, Any]:
    vm = sample_vm(name)
    vm["spec"]["overcommit"] = overcommit
    created: dict[str, Any] = client.CustomObjectsApi(api).create_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, vm,
        dry_run="All" if dry_run else None)
    return created


@pytest.mark.cluster
def test_an_overcommit_factor_outside_0_001_to_10_is_refused_and_one_inside_applies(
        api: client.ApiClient, namespace: str) -> None:
    for resource in ("cpu", "memory"):
        for factor in BAD:
            with pytest.raises(client.ApiException) as err:
                create(api, namespace, "oc", {resource: factor})
            assert err.value.status == 422, (resource, factor)
            assert f"{resource} must be a factor from 0.001 to 10" in err.value.body, \
                (resource, factor, err.value.body)
        for factor in GOOD:
            assert create(api, namespace, "oc", {resource: factor})["spec"]["overcommit"] \
                == {resource: factor}

    # Stored, and an update (overcommit stays mutable) meets the same rule.
    create(api, namespace, "oc", {"cpu": "2", "memory": "1.25"}, dry_run=False)
    custom = client.CustomObjectsApi(api)
    with pytest.raises(client.ApiException) as err:
        custom.patch_namespaced_custom_object(
            types.GROUP, types.VERSION, namespace, types.PLURAL, "oc",
            {"spec": {"overcommit": {"cpu": "0"}}})
    assert err.value.status == 422 and "cpu must be a factor" in err.value.body
    patched = custom.patch_namespaced_custom_object(
        types.GROUP, types.VERSION, namespace, types.PLURAL, "oc",
        {"spec": {"overcommit": {"cpu": "1.5"}}})
    assert patched["spec"]["overcommit"] == {"cpu": "1.5", "memory": "1.25"}
