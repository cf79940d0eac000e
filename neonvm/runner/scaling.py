"""Live scaling, the runner's side: converge QEMU to a fenced target through QMP.

The wire contract (token, fence, request and answer shapes, bounds) is
:mod:`neonvm.api.scale_protocol`. Here: the fence recorded in the work dir before QEMU is
touched (:class:`FenceStore`), vCPUs and memory plugged and unplugged one request at a
time (:class:`Scaler`), and removals that the guest may finish or refuse long after
their request answered (:class:`Removals`, re-sent after :data:`RESEND_SECONDS`). Memory
is a virtio-mem device's ``requested-size`` (:func:`converge_virtio_mem`), or DIMMs for a
QEMU started with them (``memoryProvider: DIMMSlots``): the runner reads which from
``query-memory-devices``. See docs/runner.md, "Live scaling" (the mechanism, the
endpoint, the fence rule, pending removals).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import re
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from loguru import logger

from neonvm.api.scale_protocol import (
    NO_TOKEN,
    AppliedFence,
    ScaleError,
    ScaleFence,
    ScaleLimits,
    ScaleTarget,
    check_bounds,
    fence_decision,
    parse_request,
    pod_token,
)
from neonvm.runner.qmp import QMPClient, QMPCommandError, QMPError

FENCE_FILE_NAME = "scaling-fence.json"
DIMM_ID = "dimm-slot{}"
OST_EJECT_IN_PROGRESS = 0x84
"""ACPI _OST status for an eject request the OS is still carrying out."""
MEMDEV_ID = "mem-slot{}"
CPU_ID_PREFIX = "hotplug-cpu-"
CPU_SLOT_NAME = "acpi-cpu-slot:{}"
"""How a guest's refusal is kept for a vCPU that has no device id (one QEMU created from
``-smp`` at boot): ACPI names it only by its slot, QEMU's index of the possible CPUs,
which is the ``cpu-index`` ``query-cpus-fast`` reports for it."""
REMOVAL_POLL_SECONDS = 0.05
RESEND_SECONDS = 15.0
"""A recorded removal whose device the guest has said nothing about (no ``_OST`` for
its eject request: not even 0x84, which Linux sends as soon as it takes one) for this
long gets its ``device_del`` again: the first may have raised its ACPI event before the
guest's ACPI was up, and Linux clears pending GPE bits when it brings ACPI up."""
MAX_RESENDS = 4
"""At most this many re-sends per ``device_del`` (a minute of a guest's boot): a guest
that never answers holds the pod's size until the pod is replaced, as before."""
GUEST_SIZE_PREFIX = "neonvm-guest-size:"
_GUEST_SIZE = re.compile(
    r"^neonvm-guest-size: cpus=(?P<cpus>\d+) online=(?P<online>[0-9,\-]*) "
    r"memtotal-kb=(?P<mem>\d+)$")

T = TypeVar("T")

QUERY_TIMEOUT = 2.0
"""Seconds ``GET /scale`` waits for QMP's answer (then 504). Anyone who reaches the pod's
IP may ask, unauthenticated, and each request holds one of the HTTP server's connections
while it waits: a stalled QMP must not let 32 of them keep the kubelet's probes out for
long. The controller waits 3 s for the whole answer."""


@dataclass(frozen=True)
class GuestSize:
    """What the guest says it sees (a console line from its hotplug agent)."""

    cpus_online: int
    online_list: str
    mem_total_kb: int


@dataclass(frozen=True)
class QemuSize:
    """What QEMU has plugged: vCPUs (``query-cpus-fast``) and memory (boot + DIMMs, or
    boot + what the guest has plugged of the virtio-mem device)."""

    vcpus: int
    memory_slots: int
    memory_bytes: int
    dimms: tuple[str, ...]
    cpu_paths: tuple[str, ...] = ()
    """qom-paths of the plugged vCPUs (``query-cpus-fast``)."""
    cpu_indexes: tuple[int, ...] = ()
    """Their ``cpu-index`` (in the same order): the ACPI slot of each."""
    virtio_mem: VirtioMem | None = None
    """The virtio-mem device, if QEMU has one (then ``dimms`` is empty)."""

    def has(self, device: str) -> bool:
        """Whether QEMU still lists ``device`` (a DIMM id or a vCPU qom-path)."""
        return device in self.dimms or device in self.cpu_paths


@dataclass(frozen=True)
class VirtioMem:
    """A virtio-mem device as ``query-memory-devices`` lists it."""

    id: str
    size: int
    """What the guest has plugged (bytes)."""
    requested_size: int
    """What the runner asked for (bytes)."""


def virtio_mem_slots(device: VirtioMem, slot_bytes: int) -> int:
    """Slots plugged above boot memory. A size between two slot counts (the guest is
    still plugging or unplugging) is rounded away from ``requested-size``: a change under
    way is never reported as its target reached."""
    whole, part = divmod(device.size, slot_bytes)
    return whole + 1 if part and device.size > device.requested_size else whole


def ost_refuses_eject(info: dict[str, Any]) -> bool:
    """Whether an ``ACPI_DEVICE_OST`` event's ``info`` is the guest refusing an eject.

    _OST for an eject request (source 3): 0 success, 0x84 eject in progress (Linux sends
    it before every eject); anything else (0x80-0x83, 1, 2) a failure. Any other source
    (an insert, ...) says nothing about an eject."""
    status = info.get("status")
    return (info.get("source") == 3 and isinstance(status, int)
            and status not in (0, OST_EJECT_IN_PROGRESS))


def parse_guest_size(line: str) -> GuestSize | None:
    """The guest agent's report line, else None (whole-line match)."""
    m = _GUEST_SIZE.match(line.strip())
    if m is None:
        return None
    return GuestSize(cpus_online=int(m["cpus"]), online_list=m["online"],
                     mem_total_kb=int(m["mem"]))




class FenceStore:
    """The last applied fence, in ``<work dir>/scaling-fence.json`` (atomic replace)."""

    def __init__(self, work_dir: Path) -> None:
        self.path = work_dir / FENCE_FILE_NAME

    def load(self) -> AppliedFence | None:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError) as exc:
            # Refusing everything is safer than forgetting a fence: an unreadable file
            # must be looked at by a person, not silently reset.
            raise ScaleError(500, f"cannot read {self.path}: {exc}") from None
        return AppliedFence(
            fence=ScaleFence(epoch=int(doc["fence"]["epoch"]), token=int(doc["fence"]["token"]),
                             seq=int(doc["fence"].get("seq", 0))),
            target=ScaleTarget(vcpus=int(doc["cpus"]), memory_slots=int(doc["memorySlots"])),
            recorded_at=float(doc.get("recordedAt", 0.0)),
            removals=tuple(str(r) for r in doc.get("pendingRemovals") or ()))

    def save(self, applied: AppliedFence) -> None:
        tmp = self.path.with_suffix(".tmp")
        data = json.dumps(applied.as_json()).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


# ---- QMP: what is plugged, and converging to a target ------------------------------------------


def _cpu_ids(cpus: list[dict[str, Any]]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The qom-path and the ``cpu-index`` (its ACPI slot) of each vCPU
    ``query-cpus-fast`` lists, in its order."""
    return (tuple(str(c.get("qom-path") or "") for c in cpus),
            tuple(int(c.get("cpu-index", -1)) for c in cpus))


async def query_size(qmp: QMPClient, limits: ScaleLimits) -> QemuSize:
    cpus = await qmp.execute("query-cpus-fast")
    cpu_paths, cpu_indexes = _cpu_ids(cpus)
    devices = await qmp.execute("query-memory-devices")
    dimms = tuple(str(d["data"].get("id") or "") for d in devices
                  if d.get("type") == "dimm" and "data" in d)
    plugged = sum(int(d["data"].get("size", 0)) for d in devices if "data" in d)
    boot = limits.min_slots * limits.slot_bytes
    virtio = next((VirtioMem(id=str(d["data"].get("id") or ""), size=int(d["data"]["size"]),
                             requested_size=int(d["data"].get("requested-size", 0)))
                   for d in devices if d.get("type") == "virtio-mem" and "data" in d), None)
    slots = (virtio_mem_slots(virtio, limits.slot_bytes) if virtio is not None
             else len(dimms))
    return QemuSize(vcpus=len(cpus), memory_slots=limits.min_slots + slots,
                    memory_bytes=boot + plugged, dimms=dimms,
                    cpu_paths=cpu_paths, cpu_indexes=cpu_indexes, virtio_mem=virtio)


class Removals:
    """The removals this runner started and has not seen finish, kept in the fence file
    (so a runner restarted in the same pod still knows them). Used only under the
    request lock."""

    def __init__(self, store: FenceStore, record: AppliedFence,
                 refused: set[str] | None = None, heard: set[str] | None = None,
                 asks: dict[str, tuple[float, int]] | None = None,
                 resend_seconds: float = RESEND_SECONDS,
                 max_resends: int = MAX_RESENDS) -> None:
        self._store = store
        self.record = record
        self._refused = refused if refused is not None else set()
        """Devices the guest refused to eject (QMP events): still plugged, and settled."""
        self._heard = heard if heard is not None else set()
        """Devices the guest answered an eject request for (any ``_OST`` of it): it got
        the request; re-sending it would only ask again."""
        self._asks = asks if asks is not None else {}
        """Per recorded removal: when its ``device_del`` was last sent (monotonic) and
        how many times it was re-sent."""
        self._resend_seconds = resend_seconds
        self._max_resends = max_resends
        self._cpu_slots: dict[str, str] = {}
        """vCPU qom-path -> its :data:`CPU_SLOT_NAME` (from ``query-cpus-fast``)."""

    def learn_cpus(self, paths: tuple[str, ...], indexes: tuple[int, ...]) -> None:
        """Remember the ACPI slot of each vCPU, so a refusal naming only the slot (a vCPU
        booted without an id) is matched to the removal recorded by its qom-path."""
        for path, index in zip(paths, indexes, strict=False):
            if path and index >= 0:
                self._cpu_slots[path] = CPU_SLOT_NAME.format(index)

    def _names(self, device: str) -> tuple[str, ...]:
        slot = self._cpu_slots.get(device)
        return (device, slot) if slot is not None else (device,)

    @property
    def pending(self) -> tuple[str, ...]:
        return self.record.removals

    def _write(self, removals: tuple[str, ...]) -> None:
        if removals != self.record.removals:
            self.record = AppliedFence(self.record.fence, self.record.target,
                                       self.record.recorded_at, removals)
            self._store.save(self.record)

    def start(self, device: str) -> None:
        """Recorded *before* the ``device_del`` is sent (a refusal of an earlier one no
        longer says anything about this one)."""
        self._refused.difference_update(self._names(device))
        self._heard.difference_update(self._names(device))
        self._asks[device] = (time.monotonic(), 0)
        if device not in self.record.removals:
            self._write((*self.record.removals, device))

    async def resend_unheard(self, qmp: QMPClient) -> None:
        """``device_del`` again for each recorded removal the guest has said nothing
        about for :data:`RESEND_SECONDS` (at most :data:`MAX_RESENDS` times each): the
        request may have reached a guest whose ACPI was not up yet. A removal found on
        record without a send time (a runner restarted in the same pod) counts from
        now. QEMU's error or silence changes nothing: the record stays."""
        now = time.monotonic()
        for device in self.record.removals:
            if self.refused(device) or any(n in self._heard for n in self._names(device)):
                continue
            sent, resends = self._asks.setdefault(device, (now, 0))
            if now - sent < self._resend_seconds or resends >= self._max_resends:
                continue
            self._asks[device] = (now, resends + 1)
            logger.bind(component="scaling").warning(
                "no answer from the guest to the eject of {} for {:.0f} s: device_del "
                "again ({} of {})", device, now - sent, resends + 1, self._max_resends)
            with contextlib.suppress(QMPError):
                await qmp.execute("device_del", {"id": device})

    def forget(self, device: str) -> None:
        """QEMU rejected the ``device_del`` just recorded: no removal started."""
        self._write(tuple(r for r in self.record.removals if r != device))

    def refused(self, device: str) -> bool:
        """Whether the guest refused to eject ``device`` since its removal started."""
        return any(name in self._refused for name in self._names(device))

    def take_refusals(self, devices: list[str]) -> tuple[str, ...]:
        """Those of ``devices`` the guest refused, settled: forgotten from the record
        (they stay plugged and count as plugged; no eject is coming)."""
        refused = tuple(d for d in devices if self.refused(d))
        for device in refused:
            self._refused.difference_update(self._names(device))
        self._write(tuple(r for r in self.record.removals if r not in refused))
        return refused

    def finished(self, size: QemuSize) -> None:
        """Forget those QEMU no longer lists (the guest ejected them), and those the guest
        refused (still listed, and no eject is coming: they count as plugged again)."""
        self.learn_cpus(size.cpu_paths, size.cpu_indexes)
        refused = {r for r in self.record.removals if self.refused(r)}
        for device in refused:
            self._refused.difference_update(self._names(device))
        self._write(tuple(r for r in self.record.removals
                          if size.has(r) and r not in refused))


async def settle_removals(qmp: QMPClient, removals: Removals, limits: ScaleLimits,
                          deadline: float) -> None:
    """Wait for every removal started earlier (by this request or an earlier one, whose
    fence may be older) to finish before anything is plugged or counted: a device still
    being removed is neither present (the guest may eject it at any moment, after a newer
    size was reported) nor free (it cannot be plugged again). 504 while any is left."""
    if not removals.pending:
        return

    async def gone() -> bool:
        removals.finished(await query_size(qmp, limits))
        if removals.pending:
            await removals.resend_unheard(qmp)
        return not removals.pending
    await _wait_until(gone, deadline, f"the guest ejecting {', '.join(removals.pending)} "
                                      "(removals started earlier; QEMU cannot cancel them)")


async def _unplug(qmp: QMPClient, device: str, removals: Removals | None) -> None:
    """``device_del`` of ``device`` (a DIMM id or a vCPU QOM path), recorded first.

    QEMU answering with an error means it did not start the removal (x86 vCPU unplug in
    legacy CPU hotplug mode, a device it cannot unplug): a removal recorded by this call
    is forgotten again and the request fails (502), so it does not block later plans. A
    removal recorded before (an earlier ``device_del`` still pending) stays: the error
    is QEMU's "already being removed". No answer at all (a timeout, the session gone)
    says nothing about whether the removal started: the record stays."""
    recorded = removals is not None and device in removals.pending
    if removals is not None:
        removals.start(device)
    try:
        await qmp.execute("device_del", {"id": device})
    except QMPCommandError as exc:
        if recorded:
            return  # already being removed: keep waiting for it
        if removals is not None:
            removals.forget(device)
        raise ScaleError(502, f"QEMU rejected device_del of {device}: {exc} (no removal "
                              "started; nothing recorded)") from None
    except QMPError:
        pass  # no answer: the removal may have started; the wait below tells


async def _wait_for_removals(qmp: QMPClient, leaving: list[str],
                             still: Callable[[], Awaitable[set[str]]],
                             deadline: float, removals: Removals | None, what: str) -> None:
    """Wait until each of ``leaving`` is gone from QEMU (``still``: what it lists) or
    refused by the guest. A refusal ends the wait at once: 504 naming the refused
    devices, which are settled (they stay plugged and count as plugged)."""
    async def settled() -> bool:
        listed = await still()
        done = all(d not in listed or (removals is not None and removals.refused(d))
                   for d in leaving)
        if not done and removals is not None:
            await removals.resend_unheard(qmp)
        return done
    await _wait_until(settled, deadline, what)
    listed = await still()
    refused = (removals.take_refusals([d for d in leaving if d in listed])
               if removals is not None else ())
    if refused:
        raise ScaleError(504, f"refused: the guest refused to eject {', '.join(refused)}; "
                              "it stays plugged (retry with the same fence to ask again)",
                         refused=refused)


async def _converge_all(steps: Sequence[Callable[[], Awaitable[None]]]) -> None:
    """Run ``steps`` in order. A refusal (504 ``refused``: the guest keeps a device, at
    once) does not skip the steps after it; it is raised at the end, naming every device
    refused. Any other failure ends the request there."""
    refusals: list[ScaleError] = []
    for step in steps:
        try:
            await step()
        except ScaleError as exc:
            if exc.status != 504 or not exc.refused:
                raise
            refusals.append(exc)
    if len(refusals) == 1:
        raise refusals[0]
    if refusals:
        refused = tuple(d for exc in refusals for d in exc.refused)
        raise ScaleError(504, "; ".join(str(exc) for exc in refusals), refused=refused)


async def _wait_until(check: Callable[[], Awaitable[bool]], deadline: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    while not await check():
        if loop.time() > deadline:
            raise ScaleError(504, f"{what}: not done before the request's timeout "
                                  "(the fence stays recorded; retry with it to continue)")
        await asyncio.sleep(REMOVAL_POLL_SECONDS)


_TOPOLOGY = ("node-id", "socket-id", "die-id", "cluster-id", "core-id", "thread-id")


def _slot_order(slot: dict[str, Any]) -> tuple[int, ...]:
    props = slot.get("props", {})
    return tuple(int(props.get(key, 0)) for key in _TOPOLOGY)


async def converge_cpus(qmp: QMPClient, target: int, deadline: float,
                        removals: Removals | None = None) -> None:
    """Plug or unplug vCPUs until QEMU has ``target``; waits for unplugs to finish."""
    slots = await qmp.execute("query-hotpluggable-cpus")
    # QEMU lists slots from the highest index down; plug from the lowest, unplug from the top.
    slots = sorted(slots, key=_slot_order)
    plugged = [s for s in slots if s.get("qom-path")]
    free = [s for s in slots if not s.get("qom-path")]
    if len(plugged) < target:
        for slot in free[:target - len(plugged)]:
            props = dict(slot.get("props", {}))
            props.pop("node-id", None)
            name = "-".join(str(props[k]) for k in sorted(props))
            await qmp.execute("device_add", {"driver": slot["type"],
                                             "id": f"{CPU_ID_PREFIX}{name}", **props})
    elif len(plugged) > target:
        leaving = [str(s["qom-path"]) for s in plugged[target:]]
        if removals is not None:
            removals.learn_cpus(*_cpu_ids(await qmp.execute("query-cpus-fast")))
        for path in leaving:
            await _unplug(qmp, path, removals)

        async def listed() -> set[str]:
            now = await qmp.execute("query-hotpluggable-cpus")
            return {str(s.get("qom-path")) for s in now if s.get("qom-path")}
        await _wait_for_removals(qmp, leaving, listed, deadline, removals,
                                 f"the guest ejecting {len(leaving)} vCPU(s)")


VIRTIO_MEM_GUEST_HINT = (
    "the guest has plugged nothing of its virtio-mem device: does its kernel have the "
    "virtio_mem driver loaded (the runner's and vm-builder guests load it; a kernelImage "
    "without it needs memoryProvider: DIMMSlots)?")


async def converge_virtio_mem(qmp: QMPClient, device: VirtioMem, target_slots: int,
                              limits: ScaleLimits, deadline: float) -> None:
    """Set the virtio-mem device's ``requested-size`` to ``target_slots`` above boot
    memory and wait until the guest's driver has plugged or unplugged it (``size``).

    Nothing to record or settle: a newer request simply sets another size (QEMU takes a
    new ``requested-size`` at any time), and the guest keeps working towards the last
    one. A guest that cannot give memory back (unmovable pages) retries by itself; the
    request then ends in 504 at its deadline, the fence stays recorded."""
    want = (target_slots - limits.min_slots) * limits.slot_bytes
    path = f"/machine/peripheral/{device.id}"
    if device.requested_size != want:
        await qmp.execute("qom-set", {"path": path, "property": "requested-size",
                                      "value": want})
    loop = asyncio.get_running_loop()
    while True:
        size = int(await qmp.execute("qom-get", {"path": path, "property": "size"}))
        if size == want:
            return
        if loop.time() > deadline:
            hint = f"; {VIRTIO_MEM_GUEST_HINT}" if size == 0 and want > 0 else ""
            raise ScaleError(504, f"the guest's virtio-mem driver has {size} bytes plugged, "
                                  f"{want} requested: not done before the request's timeout "
                                  f"(the fence stays recorded; retry with it to continue)"
                                  f"{hint}")
        await asyncio.sleep(REMOVAL_POLL_SECONDS)


async def converge_memory(qmp: QMPClient, target_slots: int, limits: ScaleLimits,
                          deadline: float, removals: Removals | None = None) -> None:
    """Reach ``target_slots``: through the virtio-mem device if QEMU has one
    (:func:`converge_virtio_mem`), else by DIMM count: plug DIMMs into the lowest free
    slots, or unplug the highest plugged ones. By count, not by slot identity: after the
    guest refused one eject and finished another, the plugged slots may have a gap, and
    plugging the gap before removing the slot above it would take the guest through a
    size larger than both the old plan's and the new one's."""
    size = await query_size(qmp, limits)
    if size.virtio_mem is not None:
        await converge_virtio_mem(qmp, size.virtio_mem, target_slots, limits, deadline)
        return
    present = set(size.dimms)
    slots = range(limits.min_slots, limits.max_slots)
    have = [s for s in slots if DIMM_ID.format(s) in present]
    want = max(0, target_slots - limits.min_slots)
    objects = {str(o.get("name")) for o in await qmp.execute("qom-list",
                                                             {"path": "/objects"})}
    for slot in [s for s in slots if DIMM_ID.format(s) not in present][:want - len(have)]:
        if MEMDEV_ID.format(slot) not in objects:
            await qmp.execute("object-add", {"qom-type": "memory-backend-ram",
                                             "id": MEMDEV_ID.format(slot),
                                             "size": limits.slot_bytes})
        await qmp.execute("device_add", {"driver": "pc-dimm", "id": DIMM_ID.format(slot),
                                         "memdev": MEMDEV_ID.format(slot)})
    leaving = [DIMM_ID.format(s) for s in reversed(have)][:max(0, len(have) - want)]
    try:
        for dimm in leaving:
            await _unplug(qmp, dimm, removals)
        if leaving:
            async def listed() -> set[str]:
                return set((await query_size(qmp, limits)).dimms)
            await _wait_for_removals(qmp, leaving, listed, deadline, removals,
                                     f"the guest ejecting {len(leaving)} DIMM(s)")
    except asyncio.CancelledError:
        raise  # the request answered already; the next one may be plugging: touch nothing
    except BaseException:
        # The DIMMs that did leave (one ejected, another refused) are freed all the same.
        with contextlib.suppress(QMPError):
            await _free_backends(qmp, limits)
        raise
    await _free_backends(qmp, limits)


async def _free_backends(qmp: QMPClient, limits: ScaleLimits) -> None:
    """``object-del`` of the backend of every slot QEMU lists no DIMM in (freed last:
    also those left by an earlier timeout or refusal). Only under the request lock."""
    slots = range(limits.min_slots, limits.max_slots)
    now_present = set((await query_size(qmp, limits)).dimms)
    objects = {str(o.get("name")) for o in await qmp.execute("qom-list",
                                                             {"path": "/objects"})}
    for slot in slots:
        if DIMM_ID.format(slot) not in now_present and MEMDEV_ID.format(slot) in objects:
            with contextlib.suppress(QMPError):
                await qmp.execute("object-del", {"id": MEMDEV_ID.format(slot)})


class AgentChannel:
    """The host end of the guest agent's virtio-serial port (SysfsScaling), kept open.

    One line per command (``cpus N``). The guest drops what arrives while it has the port
    closed, so callers resend until the guest reports the result.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._writer: asyncio.StreamWriter | None = None

    async def send(self, line: str) -> None:
        for attempt in (1, 2):
            try:
                if self._writer is None or self._writer.is_closing():
                    _, self._writer = await asyncio.open_unix_connection(str(self.path))
                self._writer.write(line.encode() + b"\n")
                await self._writer.drain()
                return
            except (ConnectionError, OSError) as exc:
                self._writer = None
                if attempt == 2:
                    raise ScaleError(502, f"guest agent channel {self.path}: {exc}") from None


AGENT_RESEND_SECONDS = 1.0
GUEST_POLL_SECONDS = 0.02


async def converge_cpus_sysfs(agent: AgentChannel, target: int,
                              guest_cpus: Callable[[], int | None], deadline: float) -> None:
    """SysfsScaling: ask the guest agent for ``target`` online CPUs until it reports them."""
    loop = asyncio.get_running_loop()
    next_send = loop.time()
    while guest_cpus() != target:
        now = loop.time()
        if now > deadline:
            raise ScaleError(504, f"the guest did not report {target} online CPUs before the "
                                  "request's timeout (the fence stays recorded; retry with it)")
        if now >= next_send:
            await agent.send(f"cpus {target}")
            next_send = now + AGENT_RESEND_SECONDS
        await asyncio.sleep(GUEST_POLL_SECONDS)


# ---- the runner's side: authentication, the fence, and the hand-off to the QMP loop --------------


class Scaler:
    """Shared between the HTTP thread (requests) and the supervisor's loop (QMP)."""

    def __init__(self, work_dir: Path, token_file: Path | None, limits: ScaleLimits,
                 boot: ScaleTarget, request_timeout: float = 60.0,
                 on_size: Callable[[QemuSize], None] | None = None,
                 agent_socket: Path | None = None,
                 guest_cpus: Callable[[], int | None] | None = None,
                 fence_floor: ScaleFence | None = None, pod_uid: str | None = None,
                 resend_seconds: float = RESEND_SECONDS,
                 max_resends: int = MAX_RESENDS) -> None:
        """``agent_socket`` selects SysfsScaling: vCPUs are onlined/offlined by the guest
        agent and ``guest_cpus`` (the guest's last report) says when it is done.
        ``fence_floor``: with no fence file yet, act as if this fence had been applied
        with the boot size (a new pod must refuse fences recorded before it existed).
        ``pod_uid``: the bearer is :func:`pod_token` of the token file's secret and this
        uid (None: the file's content itself, for a runner outside a pod).
        ``resend_seconds``, ``max_resends``: see :data:`RESEND_SECONDS`."""
        self.fence_floor = fence_floor
        self._pod_uid = pod_uid
        self.limits = limits
        self.mode = "SysfsScaling" if agent_socket is not None else "QmpScaling"
        self._agent = AgentChannel(agent_socket) if agent_socket is not None else None
        self._guest_cpus = guest_cpus or (lambda: None)
        self._boot = boot
        self._token_file = token_file
        self._store = FenceStore(work_dir)
        self._timeout = request_timeout
        self._on_size = on_size
        self._lock = threading.Lock()
        self._attached: tuple[asyncio.AbstractEventLoop, QMPClient] | None = None
        self._attach_lock = threading.Lock()
        self._refused: set[str] = set()
        """Devices whose removal the guest refused (from QMP events, the QMP loop only)."""
        self._heard: set[str] = set()
        """Devices the guest answered an eject request for (``_OST``; the QMP loop only)."""
        self._asks: dict[str, tuple[float, int]] = {}
        """Per recorded removal: last ``device_del`` sent, re-sends (the QMP loop only)."""
        self._resend_seconds = resend_seconds
        self._max_resends = max_resends
        self._log = logger.bind(component="scaling")

    @property
    def pod_uid(self) -> str | None:
        """The uid of the pod this runner runs in (None: not given)."""
        return self._pod_uid

    # ---- wiring (supervisor) -----------------------------------------------------------

    def attach(self, loop: asyncio.AbstractEventLoop, qmp: QMPClient) -> None:
        with self._attach_lock:
            self._attached = (loop, qmp)

    def on_qmp_event(self, event: str, data: dict[str, Any]) -> None:
        """From the supervisor's QMP reader (the loop thread): a guest that refused an
        eject. ``DEVICE_UNPLUG_GUEST_ERROR`` names the device (id and QOM path);
        ``ACPI_DEVICE_OST`` for an eject request (source 3) with a failure status is the
        guest's own answer to the ACPI eject (x86 DIMMs). A refused device is still
        plugged and no eject is coming: its removal counts as settled."""
        names: tuple[object, ...] = ()
        if event == "DEVICE_UNPLUG_GUEST_ERROR":
            names = (data.get("device"), data.get("path"))
        elif event == "ACPI_DEVICE_OST":
            info = data.get("info") or {}
            # QEMU names a DIMM by its id and a vCPU by its device id, while a vCPU
            # removal is recorded by QOM path: both names are marked. A vCPU QEMU
            # created at boot (``-smp``) has no id: only its ACPI slot (the
            # possible-CPU index, its ``cpu-index``) names it.
            device = info.get("device")
            if device:
                names = (device, f"/machine/peripheral/{device}")
            if info.get("slot-type") == "CPU" and info.get("slot") is not None:
                names = (*names, CPU_SLOT_NAME.format(info["slot"]))
            if info.get("source") != 3:
                return  # not about an eject request
            if not ost_refuses_eject(info):
                # The guest took the eject request (0x84) or finished it (0): it got
                # it, so it is not sent again (Removals.resend_unheard).
                self._heard.update(str(n) for n in names if n)
                return
        for name in names:
            if name:
                self._log.warning("the guest refused to eject {} ({})", name, event)
                self._refused.add(str(name))

    def detach(self) -> None:
        with self._attach_lock:
            self._attached = None

    def _run(self, make: Callable[[QMPClient], Awaitable[T]], timeout: float) -> T:
        with self._attach_lock:
            attached = self._attached
        if attached is None:
            raise ScaleError(503, "QEMU's QMP session is not connected (booting or stopped)")
        loop, qmp = attached

        async def call() -> T:
            return await make(qmp)
        future = asyncio.run_coroutine_threadsafe(call(), loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise ScaleError(504, "QMP did not answer in time") from None
        except QMPError as exc:
            raise ScaleError(502, f"QMP: {exc}") from None

    # ---- requests (HTTP thread) --------------------------------------------------------

    def authenticate(self, authorization: str | None) -> None:
        """Raise 401 unless ``authorization`` is ``Bearer <the token file's content>``."""
        if self._token_file is None:
            raise ScaleError(401, "scaling is disabled: the runner has no token file "
                                  "(--scaling-token-file / NEONVM_SCALING_TOKEN_FILE)",
                             reason=NO_TOKEN)
        try:
            expected = self._token_file.read_bytes().strip()
        except OSError as exc:
            raise ScaleError(401, f"scaling token file unreadable: "
                                  f"{exc.strerror or exc}") from None
        if not expected:
            raise ScaleError(401, "scaling token file is empty")
        if self._pod_uid:
            expected = pod_token(expected, self._pod_uid).encode()
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise ScaleError(401, "missing bearer token")
        if not hmac.compare_digest(given.strip().encode(), expected):
            raise ScaleError(401, "wrong bearer token")

    def last_applied(self) -> AppliedFence | None:
        """The fence file's record, else the floor (with the boot size), else None."""
        last = self._store.load()
        if last is None and self.fence_floor is not None:
            return AppliedFence(fence=self.fence_floor, target=self._boot, recorded_at=0.0)
        return last

    def scale(self, authorization: str | None, body: bytes) -> dict[str, Any]:
        """Handle ``PUT /scale``; returns the answer's JSON or raises :class:`ScaleError`."""
        self.authenticate(authorization)
        if not self._lock.acquire(timeout=self._timeout):
            raise ScaleError(503, "another scaling request is still running")
        try:
            last = self.last_applied()
            current = last.target if last is not None else self._boot
            fence, target = parse_request(body, current)
            check_bounds(target, self.limits)
            decision = fence_decision(last, fence, target)
            with self._attach_lock:
                if self._attached is None:  # refuse before recording: nothing was applied
                    raise ScaleError(503, "QEMU's QMP session is not connected (booting or "
                                          "stopped)")
            record = last if last is not None else AppliedFence(
                fence=fence, target=target, recorded_at=time.time())
            if decision == "newer":
                record = AppliedFence(fence=fence, target=target, recorded_at=time.time(),
                                      removals=last.removals if last is not None else ())
                self._store.save(record)
            removals = Removals(self._store, record, self._refused, self._heard, self._asks,
                                self._resend_seconds, self._max_resends)
            self._log.info("scale to {} vCPUs, {} memory slots (fence {}, {})",
                           target.vcpus, target.memory_slots, fence, decision)
            started = time.monotonic()
            budget = self._timeout

            async def apply(qmp: QMPClient) -> QemuSize:
                deadline = asyncio.get_running_loop().time() + budget
                # Removals an earlier request started (perhaps for an older fence) finish
                # first: until then nothing is plugged, counted or reported as applied.
                await settle_removals(qmp, removals, self.limits, deadline)
                async def cpus() -> None:
                    if self._agent is not None:
                        await converge_cpus_sysfs(self._agent, target.vcpus,
                                                  self._guest_cpus, deadline)
                    else:
                        await converge_cpus(qmp, target.vcpus, deadline, removals)

                async def memory() -> None:
                    await converge_memory(qmp, target.memory_slots, self.limits, deadline,
                                          removals)
                now = await query_size(qmp, self.limits)
                online = self._guest_cpus() if self._agent is not None else now.vcpus
                cpus_grow = online is None or target.vcpus >= online
                memory_grows = target.memory_slots >= now.memory_slots
                # Growth first: a guest refusing to give something back does not keep
                # it from getting what it asked for.
                steps = [cpus, memory] if cpus_grow or not memory_grows else [memory, cpus]
                await _converge_all(steps)
                size = await query_size(qmp, self.limits)
                removals.finished(size)
                if removals.pending:  # cannot happen: each converge waited for its own
                    raise ScaleError(504, f"removals still pending: {removals.pending}")
                return size
            size = self._run(apply, timeout=budget + 10)
            if self._on_size is not None:
                self._on_size(size)
            return {"applied": decision, "mode": self.mode, "fence": asdict(fence),
                    "target": {"cpus": target.vcpus, "memorySlots": target.memory_slots},
                    "qemu": _size_json(size), "seconds": time.monotonic() - started}
        finally:
            self._lock.release()

    def pending_removals(self, size: QemuSize) -> list[str]:
        """The recorded removals QEMU still lists (unresolved), for ``GET /scale``."""
        last = self._store.load()
        return [r for r in (last.removals if last is not None else ()) if size.has(r)]

    def query(self) -> QemuSize:
        """What QEMU has plugged now (raises :class:`ScaleError` 503 while not connected,
        504 when QMP has not answered within :data:`QUERY_TIMEOUT`)."""
        size = self._run(lambda qmp: query_size(qmp, self.limits), timeout=QUERY_TIMEOUT)
        if self._on_size is not None:
            self._on_size(size)
        return size

    async def refresh(self, qmp: QMPClient) -> None:
        """From the supervisor's loop: re-read the plugged size (periodic, cheap)."""
        size = await query_size(qmp, self.limits)
        if self._on_size is not None:
            self._on_size(size)


def _size_json(size: QemuSize) -> dict[str, Any]:
    out: dict[str, Any] = {"vcpus": size.vcpus, "memorySlots": size.memory_slots,
                           "memoryBytes": size.memory_bytes}
    if size.virtio_mem is not None:
        out["virtioMem"] = {"size": size.virtio_mem.size,
                            "requestedSize": size.virtio_mem.requested_size}
    return out
