"""A test root disk in NeonVM vm-builder's layout, with busybox stand-ins for its services.

What NeonVM's vm-builder bakes into a compute image, and what this builds (docs/runner.md,
"The vm-builder boot contract"):

* ``/neonvm/bin/``: a static busybox and its applets, so ``/neonvm/bin/init`` is busybox
  init, which reads ``/etc/inittab``;
* ``/etc/inittab`` in vm-builder's order: ``sysinit`` ``vminit``, ``once`` touch
  ``/neonvm/vmstart.allowed``, ``respawn`` udhcpc on eth0, the ACPI power button, vector
  (metrics on :9100), vm-monitor (:10301), ``vmstart``; ``shutdown`` ``vmshutdown``;
* ``vminit``: mounts ``/dev/vdb`` (ISO 9660) on ``/neonvm/runtime``, runs ``mounts.sh``,
  ``sysctl -p sysctl.conf``, brings up ``lo`` and ``eth0``;
* ``vmstart``: writes ``vmstarter.sh`` from the image's ENV, ``env.sh``, ``command.sh`` or
  the image's ENTRYPOINT, ``args.sh`` or the image's CMD, and runs it while
  ``vmstart.allowed`` exists, as vm-builder's template does (without its ``flock``, which
  busybox lacks).

The stand-ins are not NeonVM's programs: "vector" is busybox ``httpd`` serving a
``/metrics`` file that a loop rewrites every second with ``host_load1``, ``host_load5``,
``host_memory_total_bytes``, ``host_memory_available_bytes`` and
``host_memory_cached_bytes`` (the names the autoscaler-agent reads); "vm-monitor" is
``httpd`` on :10301 answering ``/monitor`` with plain text (no websocket); acpid is a
reader of the "Power Button" input device that runs ``poweroff``; ``blkid -L`` is
busybox ``findfs``. The image's own
ENTRYPOINT is ``/app/entrypoint.sh``, which prints ``VMBUILDER_ENTRYPOINT argv: ...``,
``GREETING``, the root filesystem's size, ``vm.swappiness``, the swap, the mounts of
``/data``, ``/scratch`` and ``/config`` and the files in ``/config``, then ``report
done``, and waits for SIGTERM.

``python -m neonvm.dev.vmbuilderdisk DEST`` writes ``DEST/vmbuilder.ext4`` and
``DEST/vmbuilder.qcow2`` (2 MiB clusters, lazy refcounts: vm-builder's ``qemu-img``
options). Needs what :mod:`neonvm.dev.guestdisk` needs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from neonvm.dev import guestdisk
from neonvm.runner.guestboot import shell_quote
from neonvm.runner.runtimedisk import shell_words

ENTRYPOINT_MARKER = "VMBUILDER_ENTRYPOINT"
DISK_IMAGE = "neonvm.local/rootdisk-vmbuilder:1"
"""The container image carrying this root disk at ``/disk.qcow2``, as vm-builder's do."""
VECTOR_PORT = 9100
MONITOR_PORT = 10301

INITTAB = """\
::sysinit:/neonvm/bin/vminit
::once:/neonvm/bin/touch /neonvm/vmstart.allowed
::respawn:/neonvm/bin/udhcpc -t 1 -T 1 -A 1 -f -i eth0 -s /neonvm/bin/udhcpc.script
::respawn:/neonvm/bin/acpi-watch
::respawn:/neonvm/bin/vector
::respawn:/neonvm/bin/vm-monitor
::respawn:/neonvm/bin/vmstart
::shutdown:/neonvm/bin/vmshutdown
"""

VMINIT = """\
#!/neonvm/bin/sh
export PATH=/neonvm/bin
mkdir -p /dev/pts /dev/shm
chmod 0755 /dev/pts
chmod 1777 /dev/shm
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t cgroup2 cgroup2 /sys/fs/cgroup
mount -t devpts -o noexec,nosuid devpts /dev/pts
mount -t tmpfs -o noexec,nosuid,nodev shm-tmpfs /dev/shm
# the runner's runtime disk: command, args, env, mounts, sysctls
mount -t iso9660 -o ro,mode=0644 /dev/vdb /neonvm/runtime
echo "vminit: runtime disk: $(ls /neonvm/runtime | tr '\\n' ' ')"
test -f /neonvm/runtime/mounts.sh && /neonvm/bin/sh /neonvm/runtime/mounts.sh
test -f /neonvm/runtime/sysctl.conf && /neonvm/bin/sysctl -p /neonvm/runtime/sysctl.conf
# vm-builder runs resize2fs /dev/vda here; busybox has none (the runner's initramfs grew it)
command -v resize2fs > /dev/null && resize2fs /dev/vda
ip link set up dev lo
ip link set up dev eth0
echo "vminit: done"
"""

UDHCPC_SCRIPT = """\
#!/neonvm/bin/sh
export PATH=/neonvm/bin
case "$1" in
    deconfig) ip addr flush dev "$interface"; ip link set "$interface" up ;;
    bound|renew)
        ifconfig "$interface" "$ip" netmask "${subnet:-255.255.255.0}"
        for r in $router; do ip route replace default via "$r" dev "$interface"; break; done
        [ -n "$dns" ] && for d in $dns; do echo "nameserver $d"; done > /etc/resolv.conf
        echo "udhcpc: $interface $ip" ;;
esac
exit 0
"""

ACPI_WATCH = """\
#!/neonvm/bin/sh
# Stands in for vm-builder's acpid (event=button/power action=/neonvm/bin/poweroff).
export PATH=/neonvm/bin
for d in /sys/class/input/event*; do
    [ "$(cat "$d/device/name" 2>/dev/null)" = "Power Button" ] || continue
    ( dd if="/dev/input/${d##*/}" of=/dev/null bs=24 count=1 2>/dev/null
      echo "acpi: power button: powering off"; poweroff ) &
done
wait
sleep 3600
"""

VECTOR = """\
#!/neonvm/bin/sh
# Stands in for vector's prometheus_exporter on :9100 (host_metrics source).
export PATH=/neonvm/bin
mkdir -p /run/vector
(
    while true; do
        {
            read -r l1 l5 _rest < /proc/loadavg
            echo "host_load1{collector=\\"loadavg\\"} $l1"
            echo "host_load5{collector=\\"loadavg\\"} $l5"
            awk -v l='{collector="memory"}' '
                /^MemTotal:/ {print "host_memory_total_bytes" l, $2 * 1024}
                /^MemAvailable:/ {print "host_memory_available_bytes" l, $2 * 1024}
                /^Cached:/ {print "host_memory_cached_bytes" l, $2 * 1024}' /proc/meminfo
        } > /run/vector/metrics.tmp && mv /run/vector/metrics.tmp /run/vector/metrics
        sleep 1
    done
) &
exec httpd -f -p 9100 -h /run/vector
"""

VM_MONITOR = """\
#!/neonvm/bin/sh
# Stands in for vm-monitor on :10301 (the real one speaks a websocket at /monitor).
export PATH=/neonvm/bin
mkdir -p /run/vm-monitor
echo "vm-monitor stand-in" > /run/vm-monitor/monitor
exec httpd -f -p 10301 -h /run/vm-monitor
"""

BLKID = """\
#!/neonvm/bin/sh
# Stands in for util-linux blkid -L LABEL (what the runtime disk's mounts.sh calls).
[ "$1" = -L ] && [ -n "$2" ] || { echo "usage: blkid -L LABEL" >&2; exit 2; }
# busybox findfs does not read ISO 9660 labels (the ssh-authorized-keys disk's): compare
# the volume identifier (32 bytes at 32808, space-padded) of each virtio disk first.
for d in /dev/vd?; do
  label="$(dd if="$d" bs=1 skip=32808 count=32 2>/dev/null | tr -d ' ')"
  [ "$label" = "$2" ] && { echo "$d"; exit 0; }
done
exec /neonvm/bin/findfs "LABEL=$2"
"""

VMSHUTDOWN = """\
#!/neonvm/bin/sh
rm /neonvm/vmstart.allowed
"""

ENTRYPOINT = """\
#!/bin/sh
echo "VMBUILDER_ENTRYPOINT argv: $*"
echo "VMBUILDER_ENTRYPOINT GREETING=$GREETING BAKED=$BAKED"
echo "VMBUILDER_ENTRYPOINT root-kb $(df -k / | awk 'NR == 2 {print $2}')"
echo "VMBUILDER_ENTRYPOINT swappiness $(cat /proc/sys/vm/swappiness)"
echo "VMBUILDER_ENTRYPOINT $(grep SwapTotal /proc/meminfo | tr -s ' ')"
grep -E ' (/data|/scratch|/config) ' /proc/mounts | while read -r _dev dir fs opts _rest; do
    echo "VMBUILDER_ENTRYPOINT mount $dir $fs ${opts%%,*}"
done
for f in /config/*; do
    [ -f "$f" ] && echo "VMBUILDER_ENTRYPOINT file $f: $(head -c 200 "$f")"
done
echo "VMBUILDER_ENTRYPOINT report done"
trap 'echo "VMBUILDER_ENTRYPOINT SIGTERM"; exit 0' TERM
while true; do sleep 1; done
"""


def vmstart_script(env: Sequence[str], entrypoint: Sequence[str], cmd: Sequence[str]) -> str:
    """vm-builder's ``vmstart`` rendered for an image with this ENV, ENTRYPOINT and CMD."""
    q = shell_quote
    lines = ["#!/neonvm/bin/sh", "/neonvm/bin/cat <<'EOF' >/neonvm/bin/vmstarter.sh"]
    lines += [f"export {q(e)}" for e in env]
    lines += ["EOF",
              "if /neonvm/bin/test -f /neonvm/runtime/env.sh; then",
              "    /neonvm/bin/cat /neonvm/runtime/env.sh >>/neonvm/bin/vmstarter.sh",
              "fi"]
    if not entrypoint and not cmd:
        lines += ["if /neonvm/bin/test \\( ! -f /neonvm/runtime/command.sh \\) -a "
                  "\\( ! -f /neonvm/runtime/args.sh \\); then",
                  "    /neonvm/bin/echo 'Error: No command specified' >&2",
                  "    exit 1",
                  "fi"]
    lines += ["if /neonvm/bin/test -f /neonvm/runtime/command.sh; then",
              "    /neonvm/bin/cat /neonvm/runtime/command.sh >>/neonvm/bin/vmstarter.sh",
              "else",
              f"    /neonvm/bin/echo -n {q(' ' + shell_words(entrypoint))} "
              ">>/neonvm/bin/vmstarter.sh",
              "fi",
              "if /neonvm/bin/test -f /neonvm/runtime/args.sh; then",
              "    /neonvm/bin/echo -n ' ' >>/neonvm/bin/vmstarter.sh",
              "    /neonvm/bin/cat /neonvm/runtime/args.sh >>/neonvm/bin/vmstarter.sh",
              "else",
              f"    /neonvm/bin/echo -n {q(' ' + shell_words(cmd))} >>/neonvm/bin/vmstarter.sh",
              "fi",
              "/neonvm/bin/chmod +x /neonvm/bin/vmstarter.sh",
              # vm-builder: flock -o /neonvm/vmstart.lock -c '... su-exec USER ...'; busybox
              # has no flock, and this image's user is root.
              "/neonvm/bin/test -e /neonvm/vmstart.allowed || { /neonvm/bin/sleep 1; exit 1; }",
              "exec /neonvm/bin/sh /neonvm/bin/vmstarter.sh"]
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str, mode: int = 0o755) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def build_tree(tree: Path, env: Sequence[str] = ("BAKED=from-the-image",),
               entrypoint: Sequence[str] = ("/app/entrypoint.sh",),
               cmd: Sequence[str] = ("baked-cmd",)) -> Path:
    """The image's files under ``tree`` (replaced if present)."""
    if tree.exists():
        shutil.rmtree(tree)
    for d in ("bin", "etc", "app", "proc", "sys", "dev", "tmp", "run", "var/log",
              "neonvm/bin", "neonvm/runtime", "neonvm/config"):
        (tree / d).mkdir(parents=True)
    applets = subprocess.run([str(guestdisk.BUSYBOX), "--list"], capture_output=True,
                             text=True, check=True).stdout.split()
    # The application image's own userland (/bin/sh), and vm-builder's under /neonvm/bin.
    for bin_dir in (tree / "bin", tree / "neonvm" / "bin"):
        shutil.copy2(guestdisk.BUSYBOX, bin_dir / "busybox")
        for applet in applets:
            if applet != "busybox":
                (bin_dir / applet).symlink_to("busybox")
    nb = tree / "neonvm" / "bin"
    for name, text in (("vminit", VMINIT), ("udhcpc.script", UDHCPC_SCRIPT),
                       ("acpi-watch", ACPI_WATCH), ("vector", VECTOR),
                       ("vm-monitor", VM_MONITOR), ("vmshutdown", VMSHUTDOWN),
                       ("blkid", BLKID),
                       ("vmstart", vmstart_script(env, entrypoint, cmd))):
        _write(nb / name, text)
    _write(nb / "inittab", INITTAB, 0o644)
    _write(tree / "etc" / "inittab", INITTAB, 0o644)
    _write(tree / "app" / "entrypoint.sh", ENTRYPOINT)
    return tree


def build_disk(dest: Path, size_mib: int = 32, **image: Sequence[str]) -> tuple[Path, Path]:
    """``(vmbuilder.ext4, vmbuilder.qcow2)`` in ``dest``: ext4 labelled ``vmroot``, as
    vm-builder makes it; ``image`` overrides ``env``, ``entrypoint``, ``cmd``."""
    absent = guestdisk.missing()
    if absent:
        raise RuntimeError("cannot build the vm-builder test disk, missing: " + ", ".join(absent))
    dest.mkdir(parents=True, exist_ok=True)
    tree = build_tree(dest / "vmbuilder-rootfs", **image)
    tools = "/usr/sbin:/sbin:/usr/bin:/bin"
    mkfs, qemu_img = shutil.which("mkfs.ext4", path=tools), shutil.which("qemu-img", path=tools)
    assert mkfs is not None and qemu_img is not None
    raw = dest / "vmbuilder.ext4"
    raw.unlink(missing_ok=True)
    with raw.open("wb") as f:
        f.truncate(size_mib << 20)
    subprocess.run([mkfs, "-q", "-F", "-L", "vmroot", "-d", str(tree), str(raw)], check=True,
                   capture_output=True)
    qcow2 = dest / "vmbuilder.qcow2"
    qcow2.unlink(missing_ok=True)
    subprocess.run([qemu_img, "convert", "-q", "-f", "raw", "-O", "qcow2", "-o",
                    "cluster_size=2M,lazy_refcounts=on", str(raw), str(qcow2)], check=True)
    for path in (raw, qcow2):
        path.chmod(0o644)
    return raw, qcow2


if __name__ == "__main__":
    ext4, qcow = build_disk(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("."))
    print(f"ext4: {ext4}\nqcow2: {qcow}")
