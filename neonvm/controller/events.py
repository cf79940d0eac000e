"""Kubernetes Events on VirtualMachines: plan, commit, restart, clean-up, alarms.

Events are for people (``kubectl describe neonvm``), never for the controller's own logic:
recording one is best effort, and a failure is logged and otherwise ignored.
"""

from __future__ import annotations

import datetime as dt
import uuid

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from loguru import logger
from urllib3.exceptions import HTTPError

from neonvm.api import types
from neonvm.api.types import VirtualMachine

COMPONENT = "neonvm-controller"


class EventRecorder:
    """Writes core/v1 Events about VMs (best effort)."""

    def __init__(self, api: client.ApiClient | None, identity: str = "") -> None:
        self._core = client.CoreV1Api(api) if api is not None else None
        self._identity = identity

    def record(self, vm: VirtualMachine, reason: str, message: str,
               warning: bool = False) -> None:
        log = logger.bind(vm=vm.key, reason=reason)
        (log.warning if warning else log.info)("event: {message}", message=message)
        if self._core is None:
            return
        now = dt.datetime.now(dt.UTC)
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(
                name=f"{vm.name}.{uuid.uuid4().hex[:16]}", namespace=vm.namespace),
            involved_object=client.V1ObjectReference(
                api_version=types.API_VERSION, kind=types.KIND, name=vm.name,
                namespace=vm.namespace, uid=vm.uid, resource_version=vm.resource_version),
            reason=reason,
            message=message[:1024],
            type="Warning" if warning else "Normal",
            source=client.V1EventSource(component=COMPONENT),
            reporting_component=COMPONENT,
            reporting_instance=self._identity or None,
            first_timestamp=now,
            last_timestamp=now,
            count=1,
        )
        try:
            self._core.create_namespaced_event(vm.namespace, event, _request_timeout=10)
        except (ApiException, HTTPError, OSError) as exc:
            log.debug("could not record event: {err}", err=exc)
