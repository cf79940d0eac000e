"""A tiny kubelet device plugin that hands ``/dev/kvm`` to runner pods.

Runner pods are never privileged and mount nothing from the host, so the only way
``/dev/kvm`` gets into their container is a device plugin: the kubelet asks it, at
container creation, which device nodes to add. This one advertises ``count`` identical
devices of one extended resource (``devices.kubevirt.io/kvm`` by default, KubeVirt's name,
which shares ``/dev/kvm`` among 1000 the same way; NeonVM's runner pods ask for
``neonvm/kvm`` instead, docs/neonvm-compat.md) while ``/dev/kvm`` exists, and for
each allocation adds ``/dev/kvm`` with ``rw`` permissions. A runner pod whose VM has
``enableAcceleration`` requests one (the controller's ``--kvm-resource``). The chart can
run it as a DaemonSet (``kvmDevicePlugin.enabled``).

Protocol: the kubelet's ``v1beta1`` device plugin API over gRPC on unix sockets in
``/var/lib/kubelet/device-plugins/``. The plugin serves ``DevicePlugin`` on its own
socket there, then calls ``Registration/Register`` on ``kubelet.sock``. When the kubelet
restarts it removes every socket in that directory; the plugin notices its socket gone
and registers again. The few messages used are encoded here by hand (proto3 wire format:
varints and length-delimited fields), so no generated code is needed beside ``grpcio``.

Not guaranteed: that KVM works when ``/dev/kvm`` exists (this development machine has a
``/dev/kvm`` but no vmx/svm); the runner checks that itself and reports
``AccelerationUnavailable``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from loguru import logger

API_VERSION = "v1beta1"
DEFAULT_RESOURCE = "devices.kubevirt.io/kvm"
DEFAULT_DIR = Path("/var/lib/kubelet/device-plugins")
KUBELET_SOCKET = "kubelet.sock"
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"


# ---- proto3 wire format, just what the device plugin API needs -----------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def field_bytes(number: int, data: bytes) -> bytes:
    """A length-delimited field (string, bytes or embedded message)."""
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def field_bool(number: int, value: bool) -> bytes:
    return _varint(number << 3) + _varint(int(value)) if value else b""


def parse(data: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) pairs of one message: ints for varints, bytes otherwise."""
    out: list[tuple[int, int | bytes]] = []
    i = 0

    def varint() -> int:
        nonlocal i
        shift = result = 0
        while True:
            byte = data[i]
            i += 1
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return result
            shift += 7

    while i < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            out.append((number, varint()))
        elif wire == 2:
            length = varint()
            out.append((number, data[i:i + length]))
            i += length
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    return out


def register_request(endpoint: str, resource: str) -> bytes:
    """RegisterRequest{version, endpoint, resource_name, options{}}."""
    return (field_bytes(1, API_VERSION.encode()) + field_bytes(2, endpoint.encode())
            + field_bytes(3, resource.encode()) + field_bytes(4, b""))


def list_and_watch_response(ids: list[str], health: str) -> bytes:
    """ListAndWatchResponse{devices: [Device{ID, health}]}."""
    return b"".join(field_bytes(1, field_bytes(1, i.encode()) + field_bytes(2, health.encode()))
                    for i in ids)


def allocate_request_ids(data: bytes) -> list[list[str]]:
    """AllocateRequest → the device IDs of each container request."""
    return [[bytes(v).decode() for n, v in parse(bytes(req)) if n == 1 and isinstance(v, bytes)]
            for number, req in parse(data) if number == 1 and isinstance(req, bytes)]


def allocate_response(containers: int, device: str) -> bytes:
    """AllocateResponse: each container gets DeviceSpec{device, device, "rw"}."""
    spec = field_bytes(1, device.encode()) + field_bytes(2, device.encode()) + \
        field_bytes(3, b"rw")
    return b"".join(field_bytes(1, field_bytes(3, spec)) for _ in range(containers))


# ---- the plugin ----------------------------------------------------------------------------


def _identity(data: bytes) -> bytes:
    return data


@dataclass
class KvmDevicePlugin:
    """Serve the plugin, register it, re-register after a kubelet restart."""

    resource: str = DEFAULT_RESOURCE
    count: int = 100
    device: Path = Path("/dev/kvm")
    plugin_dir: Path = DEFAULT_DIR
    poll_seconds: float = 2.0
    probe: Path | None = None
    """Where to check that the device exists (health), if not ``device`` itself: in the
    chart's DaemonSet the host's /dev is mounted at /host/dev."""

    def __post_init__(self) -> None:
        self.socket_name = self.resource.replace("/", "_").replace(".", "-") + ".sock"
        self._stop = threading.Event()
        self.allocations = 0

    @property
    def socket(self) -> Path:
        return self.plugin_dir / self.socket_name

    def _health(self) -> str:
        return HEALTHY if (self.probe or self.device).exists() else UNHEALTHY

    # DevicePlugin service handlers (raw bytes in, raw bytes out).
    def get_options(self, _request: bytes, _context: Any) -> bytes:
        return b""  # DevicePluginOptions: nothing required before start, no preference

    def list_and_watch(self, _request: bytes, context: Any) -> Iterator[bytes]:
        ids = [f"kvm{i}" for i in range(self.count)]
        health = self._health()
        yield list_and_watch_response(ids, health)
        while not self._stop.is_set() and context.is_active():
            self._stop.wait(self.poll_seconds)
            now = self._health()
            if now != health:
                health = now
                logger.info("{} is now {}", self.device, health)
                yield list_and_watch_response(ids, health)

    def allocate(self, request: bytes, _context: Any) -> bytes:
        containers = allocate_request_ids(request)
        self.allocations += len(containers)
        logger.info("allocate {} for {} container(s)", self.device, len(containers))
        return allocate_response(len(containers), str(self.device))

    def preferred(self, _request: bytes, _context: Any) -> bytes:
        return b""

    def pre_start(self, _request: bytes, _context: Any) -> bytes:
        return b""

    def _server(self) -> grpc.Server:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        unary = {"GetDevicePluginOptions": self.get_options, "Allocate": self.allocate,
                 "GetPreferredAllocation": self.preferred, "PreStartContainer": self.pre_start}
        handlers: dict[str, grpc.RpcMethodHandler] = {
            name: grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=_identity, response_serializer=_identity)
            for name, fn in unary.items()}
        handlers["ListAndWatch"] = grpc.unary_stream_rpc_method_handler(
            self.list_and_watch, request_deserializer=_identity,
            response_serializer=_identity)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(f"{API_VERSION}.DevicePlugin", handlers),))
        self.socket.unlink(missing_ok=True)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        return server

    def register(self, timeout: float = 10.0) -> None:
        with grpc.insecure_channel(f"unix://{self.plugin_dir / KUBELET_SOCKET}") as channel:
            call = channel.unary_unary(f"/{API_VERSION}.Registration/Register",
                                       request_serializer=_identity,
                                       response_deserializer=_identity)
            call(register_request(self.socket_name, self.resource), timeout=timeout)

    def serve_once(self) -> None:
        """Serve and register until the socket disappears (kubelet restart) or stop()."""
        server = self._server()
        try:
            self.register()
            logger.info("registered {} ({} devices of {}) at {}", self.resource, self.count,
                        self.device, self.socket)
            while not self._stop.is_set() and self.socket.exists():
                self._stop.wait(self.poll_seconds)
        finally:
            server.stop(grace=1)
            self.socket.unlink(missing_ok=True)

    def run(self) -> None:
        while not self._stop.is_set():
            if not (self.plugin_dir / KUBELET_SOCKET).exists():
                self._stop.wait(self.poll_seconds)
                continue
            try:
                self.serve_once()
            except grpc.RpcError as exc:
                logger.warning("registration failed: {}", exc)
                self._stop.wait(self.poll_seconds)
            if not self._stop.is_set():
                logger.info("{} is gone (kubelet restarted?): registering again", self.socket)

    def stop(self) -> None:
        self._stop.set()


def main(resource: str, count: int, device: Path, plugin_dir: Path,
         probe: Path | None = None) -> None:
    import signal

    plugin = KvmDevicePlugin(resource=resource, count=count, device=device,
                             plugin_dir=plugin_dir, probe=probe)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: plugin.stop())
    logger.info("KVM device plugin for {} ({} devices of {}) in {}; pid {}", resource, count,
                device, plugin_dir, os.getpid())
    started = time.monotonic()
    plugin.run()
    logger.info("stopped after {:.0f}s", time.monotonic() - started)
