"""The VirtualMachine CustomResourceDefinition, generated from :mod:`neonvm.api.types`.

``neonvm manifests crd`` prints it; the chart's copy under ``charts/`` is written by
``neonvm manifests write`` and a test fails if it ever differs from this output.
"""

from __future__ import annotations

from typing import Any

from neonvm.api import types
from neonvm.api.schema import openapi_schema

MAX_NAME = 63
"""VM names are label values (``vm.neon.tech/name``) on runner pods, which allow 63."""

PRINTER_COLUMNS = [
    # NeonVM's columns, in NeonVM's order (``kubectl get neonvm``; ``-o wide`` adds the
    # priority-1 ones). NeonVM's Restarts column reads ``.status.restarts``, a field its
    # status does not have; here it reads ``restartCount``, so it shows the count.
    {"name": "Cpus", "type": "string", "jsonPath": ".status.cpus"},
    {"name": "Memory", "type": "string", "jsonPath": ".status.memorySize"},
    {"name": "Pod", "type": "string", "jsonPath": ".status.podName"},
    {"name": "ExtraIP", "type": "string", "jsonPath": ".status.extraNetIP"},
    {"name": "Status", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restartCount"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Node", "type": "string", "jsonPath": ".status.node", "priority": 1},
    {"name": "Image", "type": "string", "jsonPath": ".spec.guest.rootDisk.image",
     "priority": 1},
    {"name": "CPUScalingMode", "type": "string", "jsonPath": ".spec.cpuScalingMode",
     "priority": 1},
    {"name": "TargetArchitecture", "type": "string", "jsonPath": ".spec.targetArchitecture",
     "priority": 1},
    # This controller's own: the plan in flight (the runner pod being created).
    {"name": "Pending", "type": "string", "jsonPath": ".status.pendingPod.name",
     "priority": 1},
]


def virtualmachine_crd() -> dict[str, Any]:
    """The CRD object, ready to create or to dump as YAML."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{types.PLURAL}.{types.GROUP}",
            "labels": {"app.kubernetes.io/part-of": "neonvm"},
        },
        "spec": {
            "group": types.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": types.KIND,
                "listKind": f"{types.KIND}List",
                "plural": types.PLURAL,
                "singular": types.SINGULAR,
                **({"shortNames": types.SHORT_NAMES} if types.SHORT_NAMES else {}),
            },
            "versions": [
                {
                    "name": types.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A virtual machine run by exactly one runner pod.",
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": openapi_schema(types.VirtualMachineSpec),
                                "status": openapi_schema(types.VirtualMachineStatus),
                            },
                            "required": ["spec"],
                            "x-kubernetes-validations": [
                                {
                                    "rule": f"self.metadata.name.size() <= {MAX_NAME}",
                                    "message": f"a VirtualMachine name is at most {MAX_NAME} "
                                    "characters: it is a label value on its runner pods",
                                }
                            ],
                        }
                    },
                }
            ],
        },
    }
