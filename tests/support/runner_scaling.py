"""A runner's ``/scale`` in tests: PUT it, read what the guest sees, a QMP that ejects slowly."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from neonvm.runner.qmp import QMPCommandError, QMPError
from tests.support import wait_for
from tests.support.runner import RunningRunner

GIB = 1 << 30


TOKEN = "s3cret-scaling-token"


class SlowEjectQMP:
    """A QMP stand-in for the unit tests: memory DIMMs whose ``device_del`` the guest
    finishes only when the test says so (:meth:`eject`), as QEMU does (the device stays
    listed until the guest has ejected it, and the removal cannot be cancelled).

    ``rejected``: devices whose ``device_del`` QEMU answers with an error (no removal
    starts); ``unanswered``: devices whose ``device_del`` QEMU carries out but whose
    answer never comes; ``refusing``: devices the guest refuses to eject as soon as it is
    asked, reported to ``on_event`` as QEMU does (``_OST`` 0x84, then 0x82 "busy")."""

    def __init__(self, dimms: int, vcpus: int = 1, max_vcpus: int = 1,
                 hotplugged: int = 0) -> None:
        """``vcpus`` booted (``-smp``: no device id, a path QEMU makes up, an ACPI
        refusal names only their slot), then ``hotplugged`` added with ids."""
        self.dimms = {f"dimm-slot{i}": f"mem-slot{i}" for i in range(1, dimms + 1)}
        self.cpus: dict[int, str | None] = {
            i: (f"/machine/unattached/device[{2 * i}]" if i < vcpus
                else f"/machine/peripheral/hotplug-cpu-0-{i}-0" if i < vcpus + hotplugged
                else None) for i in range(max_vcpus)}
        self.objects = set(self.dimms.values())
        self.removing: set[str] = set()
        self.calls: list[tuple[str, dict[str, Any] | None]] = []
        self.rejected: set[str] = set()
        self.unanswered: set[str] = set()
        self.refusing: set[str] = set()
        self.prompt: set[str] = set()
        """Devices the guest ejects as soon as it is asked."""
        self.deaf: dict[str, int] = {}
        """Per device: how many more of its ``device_del`` the guest never hears (its
        ACPI not up yet): QEMU starts the removal, no _OST, no eject."""
        self.taking: set[str] = set()
        """Devices whose eject request the guest takes (``_OST`` 0x84) without finishing
        it until the test says so."""
        self.on_event: Any = None

    def _ost_names(self, device: str) -> dict[str, str]:
        """How QEMU names a device in ACPI_DEVICE_OST: ``device`` only when it has an
        id; ``slot`` is the DIMM's slot or the vCPU's index among the possible CPUs."""
        if device in self.dimms:
            return {"device": device, "slot": device.removeprefix("dimm-slot"),
                    "slot-type": "DIMM"}
        index = next(i for i, p in self.cpus.items() if p == device)
        peripheral = device.startswith("/machine/peripheral/")
        return {**({"device": device.rsplit("/", 1)[-1]} if peripheral else {}),
                "slot": str(index), "slot-type": "CPU"}

    def eject(self, device: str) -> None:
        assert device in self.removing
        self.removing.discard(device)
        if device in self.dimms:
            del self.dimms[device]
        else:
            self.cpus = {i: (None if p == device else p) for i, p in self.cpus.items()}

    async def execute(self, command: str, args: dict[str, Any] | None = None) -> Any:
        self.calls.append((command, args))
        if command == "query-cpus-fast":
            return [{"cpu-index": i, "qom-path": p} for i, p in self.cpus.items() if p]
        if command == "query-hotpluggable-cpus":
            return [{"type": "qemu64-x86_64-cpu", "vcpus-count": 1,
                     "props": {"socket-id": 0, "core-id": i, "thread-id": 0},
                     **({"qom-path": p} if p else {})} for i, p in self.cpus.items()]
        if command == "query-memory-devices":
            return [{"type": "dimm", "data": {"id": d, "size": GIB, "memdev": m}}
                    for d, m in sorted(self.dimms.items())]
        if command == "qom-list":
            return [{"name": o, "type": "child<memory-backend-ram>"} for o in self.objects]
        if command == "object-add":
            assert args is not None
            self.objects.add(args["id"])
            return {}
        if command == "object-del":
            assert args is not None
            self.objects.discard(args["id"])
            return {}
        if command == "device_add" and args is not None and args["driver"] != "pc-dimm":
            assert self.cpus[args["core-id"]] is None, args
            self.cpus[args["core-id"]] = f"/machine/peripheral/{args['id']}"
            return {}
        if command == "device_add":
            assert args is not None and args["id"] not in self.dimms, args
            self.dimms[args["id"]] = args["memdev"]
            return {}
        if command == "device_del":
            assert args is not None, args
            assert args["id"] in self.dimms or args["id"] in self.cpus.values(), args
            if args["id"] in self.rejected:
                raise QMPCommandError(f"GenericError: device_del of {args['id']} refused")
            self.removing.add(args["id"])  # the guest has not ejected it yet
            if self.deaf.get(args["id"], 0) > 0:
                self.deaf[args["id"]] -= 1
                return {}  # the ACPI event is lost: the guest never hears of it
            if args["id"] in self.taking:
                asyncio.get_running_loop().call_soon(self.on_event, "ACPI_DEVICE_OST", {
                    "info": {**self._ost_names(args["id"]), "source": 3,
                             "status": 0x84}})
            if args["id"] in self.refusing:
                self.removing.discard(args["id"])  # it stays plugged
                for status in (0x84, 0x82):
                    asyncio.get_running_loop().call_soon(self.on_event, "ACPI_DEVICE_OST", {
                        "info": {**self._ost_names(args["id"]), "source": 3,
                                 "status": status}})
            if args["id"] in self.prompt:
                self.eject(args["id"])
            if args["id"] in self.unanswered:
                raise QMPError("device_del: no answer within 10s")
            return {}
        raise AssertionError(f"unexpected QMP command {command}")


@pytest.fixture
def qmp_loop() -> Any:
    import asyncio
    import threading
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def put_scale(runner: RunningRunner, body: dict[str, Any], token: str | None = TOKEN
              ) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(f"http://127.0.0.1:{runner.port}/scale", method="PUT",
                                     data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def guest_sees(runner: RunningRunner, cpus: int | None = None,
               mem_kb: tuple[int, int] | None = None, timeout: float = 180) -> dict[str, Any]:
    """Wait until the guest reports ``cpus`` online and MemTotal within ``mem_kb``."""
    def seen() -> dict[str, Any] | None:
        status = runner.status()
        if status is None or status["guestCpusOnline"] is None:
            return None
        if cpus is not None and status["guestCpusOnline"] != cpus:
            return None
        if mem_kb is not None and not mem_kb[0] <= status["guestMemTotalKb"] <= mem_kb[1]:
            return None
        return status
    return wait_for(seen, timeout=timeout, interval=0.2,
                    what=f"the guest to report cpus={cpus} memtotal in {mem_kb}")
