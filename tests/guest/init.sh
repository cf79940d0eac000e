#!/bin/busybox sh
# /init of the runner tests' guest: a busybox initramfs on the distribution kernel.
#
# It reports what it sees (CPUs, memory, disks, the runner's fw_cfg config) on the
# serial console, prints the ready marker, and then behaves as the kernel command line
# says (neonvm.test=MODE):
#   powerdown (default)  power off when the ACPI power button is pressed
#   ignore-powerdown     never power off (the runner must kill it after its grace period)
#   poweroff             power off on its own right after the marker
#   panic                crash the kernel right after the marker
# The power-button watchers are armed *before* the marker, so a press that follows the
# marker is never lost.
#
# Live scaling: the guest side (hotplug handler, SysfsScaling agent, size reports) is
# the runner's own, neonvm/runner/guest_scaling.sh, installed beside this init as
# /lib/neonvm/guest-scaling.sh (tests/guest/build.py, rootfs.py); it starts before the
# marker. See that file and docs/runner.md, "What the guest must do".

/bin/busybox mkdir -p /proc /sys /dev /mnt /tmp
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev
/bin/busybox --install -s /bin
export PATH=/bin

for m in virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci \
         virtio_blk virtio_console virtio_mem qemu_fw_cfg evdev button; do
    [ -f /lib/modules/$m.ko ] && insmod /lib/modules/$m.ko 2>/dev/null
done

mode=powerdown
for word in $(cat /proc/cmdline); do
    case "$word" in neonvm.test=*) mode=${word#neonvm.test=} ;; esac
done
marker=NEONVM_GUEST_READY
for word in $(cat /proc/cmdline); do
    case "$word" in neonvm.marker=*) marker=${word#neonvm.marker=} ;; esac
done

echo "guest: mode=$mode"
echo "guest: cpus online=$(cat /sys/devices/system/cpu/online) possible=$(cat /sys/devices/system/cpu/possible)"
echo "guest: $(grep MemTotal /proc/meminfo | tr -s ' ')"

config=/sys/firmware/qemu_fw_cfg/by_name/opt/vm.neon.tech/config/raw
if [ -r "$config" ]; then
    echo "guest: config begin"
    cat "$config"
    echo "guest: config end"
fi

# Give udev-less devtmpfs a moment: the virtio disks appear as the modules bind.
for i in 1 2 3 4 5 6 7 8 9 10; do
    ls /sys/block | grep -q vd && break
    sleep 0.2
done
for dev in /sys/block/vd*; do
    [ -e "$dev" ] || continue
    name=${dev##*/}
    serial=$(cat "$dev/serial" 2>/dev/null)
    ro=$(cat "$dev/ro")
    echo "guest: disk $name serial=$serial ro=$ro sectors=$(cat $dev/size)"
    mkdir -p /mnt/$name
    if [ "$ro" = 1 ]; then opts=ro; else opts=rw; fi
    if mount -t ext4 -o $opts /dev/$name /mnt/$name 2>/dev/null; then
        [ -f /mnt/$name/greeting ] && echo "guest: $serial says: $(cat /mnt/$name/greeting)"
        if [ "$ro" = 0 ]; then
            echo written > /mnt/$name/probe && echo "guest: wrote to $serial"
        fi
        umount /mnt/$name
    fi
done

watch_power_button() {
    # The event device is opened here, in this shell, before the marker is printed:
    # evdev queues events only for readers that already have it open, so a press right
    # after the marker waits in the queue instead of being lost.
    fd=3
    for d in /sys/class/input/event*; do
        [ "$(cat $d/device/name 2>/dev/null)" = "Power Button" ] || continue
        eval "exec $fd</dev/input/${d##*/}"
        (
            eval "dd of=/dev/null bs=24 count=1 <&$fd" 2>/dev/null
            echo "guest: power button pressed, powering off"
            sync
            poweroff -f
        ) &
        echo "guest: watching ${d##*/} for the power button"
        fd=$((fd + 1))
    done
}

case "$mode" in
    powerdown) watch_power_button ;;
    ignore-powerdown) echo "guest: ignoring the power button" ;;
esac

/bin/busybox sh /lib/neonvm/guest-scaling.sh start

echo "$marker"

case "$mode" in
    poweroff) echo "guest: powering off on my own"; poweroff -f ;;
    panic) echo "guest: crashing"; echo c > /proc/sysrq-trigger ;;
esac

while true; do sleep 3600; done
