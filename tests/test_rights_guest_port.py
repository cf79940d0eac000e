"""The rights port is closed to every guest while the controller has a rights URL, whether
or not its pod self-fences (docs/security.md, "Rights endpoint"): the leader's listener
is reachable from any runner pod, so a pod built without self-fencing (no scaling token,
or built before ``rbac.liveScaling`` was turned on) gets the URL to close
(``NEONVM_RIGHTS_CLOSED_URL``), and its runner's guest filter closes that port as a
self-fencing runner's does. On crafted frames, through the runner's own filter."""

from __future__ import annotations

import dataclasses
import ipaddress
import struct
from typing import Any

import click
import pytest

from neonvm.api.rights import RIGHTS_CLOSED_ENV, RIGHTS_URL_ENV
from neonvm.api.types import (
    PendingPod,
    VirtualMachine,
)
from neonvm.controller import podspec
from neonvm.runner.guestnet import DEFAULT_GUEST_NETWORK, frame_verdict
from neonvm.runner.main import guest_blocked, runner_options
from tests.support.rights import fencing_vm

pytestmark = pytest.mark.unit


def scalable_vm(token: str | None = "neonvm-scaling-x") -> VirtualMachine:
    return fencing_vm(token, scalable=True)


def syn(dst: str, dport: int) -> bytes:
    """A guest's TCP SYN from 10.0.2.15 to ``dst:dport``, as an Ethernet frame."""
    segment = struct.pack("!HHIIBBHHH", 40000, dport, 1, 0, 5 << 4, 0x02, 65535, 0, 0)
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(segment), 1, 0x4000, 64, 6, 0,
                         ipaddress.IPv4Address("10.0.2.15").packed,
                         ipaddress.IPv4Address(dst).packed)
    return (b"\x52\x55\x0a\x00\x02\x02\x52\x54\x00\x12\x34\x56\x08\x00"
            + header + segment)

URL = "http://10.96.12.34:8082"
PLAN = PendingPod(name="vm-01234567-1", plan_seq=1, token=40, epoch=3, generation=1)
ON = podspec.PodDefaults(right_seconds=30.0, rights_url=URL)


def env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


def leader_reached(pod_env: dict[str, Any]) -> list[str | None]:
    """The runner's filter verdicts, built from ``pod_env`` as the runner reads it, for a
    guest's SYN to the rights port at the Service's address and at the leader's pod IP."""
    blocked = guest_blocked(pod_env.get(RIGHTS_URL_ENV), pod_env.get(RIGHTS_CLOSED_ENV))
    return [frame_verdict(syn(address, 8082), DEFAULT_GUEST_NETWORK, False, blocked)
            for address in ("10.96.12.34", "10.244.1.7")]


def own_image(v: VirtualMachine) -> VirtualMachine:
    return dataclasses.replace(v, spec=dataclasses.replace(v.spec, runner_image="mine:1"))


@pytest.mark.parametrize("v", [fencing_vm(), scalable_vm(None), own_image(scalable_vm())],
                         ids=["no-token", "scalable-no-token", "own-runner-image"])
def test_a_pod_that_does_not_self_fence_still_has_the_rights_port_closed(
        v: VirtualMachine) -> None:
    pod_env = env(podspec.runner_pod(v, PLAN, ON))
    assert RIGHTS_URL_ENV not in pod_env, "it does not self-fence"
    assert pod_env[RIGHTS_CLOSED_ENV] == URL
    assert leader_reached(pod_env) == [
        "TCP connection to 10.96.12.34:8082 (a blocked endpoint)",
        "TCP connection to 10.244.1.7:8082 (a blocked endpoint)"]


def test_a_self_fencing_pod_closes_the_port_by_its_own_url() -> None:
    pod_env = env(podspec.runner_pod(scalable_vm(), PLAN, ON))
    assert pod_env[RIGHTS_URL_ENV] == URL and RIGHTS_CLOSED_ENV not in pod_env
    assert None not in leader_reached(pod_env)


def test_without_a_rights_url_nothing_more_is_closed() -> None:
    pod_env = env(podspec.runner_pod(fencing_vm(), PLAN, podspec.PodDefaults()))
    assert RIGHTS_CLOSED_ENV not in pod_env and RIGHTS_URL_ENV not in pod_env
    assert leader_reached(pod_env) == [None, None]


def test_the_runner_reads_the_url_to_close_from_its_environment() -> None:
    command = click.command()(runner_options(lambda **_: None))
    (option,) = [p for p in command.params if p.name == "rights_closed_url"]
    assert isinstance(option, click.Option) and option.envvar == RIGHTS_CLOSED_ENV
