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
# Live scaling: busybox `uevent` listens to the kernel's netlink uevents and runs this
# same script with --neonvm-hotplug for each, one at a time. A hot-added CPU is onlined
# (x86 kernels leave it offline), a hot-added memory block that is still offline is
# onlined movable (the runner also passes memhp_default_state=online_movable), and after
# every cpu or memory event the guest reports what it sees on the console:
#   neonvm-guest-size: cpus=N online=LIST memtotal-kb=K
# Removal needs nothing from here: on ACPI eject the kernel offlines the CPU or memory
# block itself, then QEMU drops the device.
#
# SysfsScaling (neonvm.cpu_scaling=sysfs and maxcpus=USE on the kernel command line): all
# vCPUs are present, USE of them online. An agent reads "cpus N" lines from the
# virtio-serial port named vm.neon.tech.agent, onlines cpu1..cpuN-1, offlines the rest,
# and reports. Hot-added CPUs are then not onlined by the hotplug handler.

report_size() {
    n=0
    for c in /sys/devices/system/cpu/cpu[0-9]*; do
        if [ -f $c/online ]; then
            read v < $c/online
            [ "$v" = 1 ] && n=$((n + 1))
        else
            n=$((n + 1))  # the boot CPU has no online switch
        fi
    done
    read online < /sys/devices/system/cpu/online
    mem=0
    while read key value unit; do
        [ "$key" = MemTotal: ] && mem=$value && break
    done < /proc/meminfo
    echo "neonvm-guest-size: cpus=$n online=$online memtotal-kb=$mem" > /dev/console
}

set_online_cpus() {
    i=1
    while [ -d /sys/devices/system/cpu/cpu$i ]; do
        if [ $i -lt "$1" ]; then v=1; else v=0; fi
        read now < /sys/devices/system/cpu/cpu$i/online
        [ "$now" = $v ] || echo $v > /sys/devices/system/cpu/cpu$i/online
        i=$((i + 1))
    done
}

sysfs_agent() {
    port=
    for p in /sys/class/virtio-ports/*; do
        [ "$(cat $p/name 2>/dev/null)" = vm.neon.tech.agent ] && port=/dev/${p##*/}
    done
    if [ -z "$port" ]; then
        echo "guest: no vm.neon.tech.agent port: SysfsScaling agent not started"
        return
    fi
    echo "guest: SysfsScaling agent on $port"
    while true; do
        # EOF while the host end is not connected: wait and reopen.
        while read -r cmd arg; do
            case "$cmd" in cpus) set_online_cpus "$arg" ;; esac
            report_size
        done < $port
        sleep 0.5
    done
}

cpu_scaling=qmp
for word in $(cat /proc/cmdline 2>/dev/null); do
    case "$word" in neonvm.cpu_scaling=sysfs) cpu_scaling=sysfs ;; esac
done

if [ "$1" = --neonvm-hotplug ]; then
    case "$SUBSYSTEM:$ACTION" in
        cpu:add)
            [ $cpu_scaling = qmp ] && [ -f /sys$DEVPATH/online ] \
                && echo 1 > /sys$DEVPATH/online 2>/dev/null ;;
        memory:add)
            read state < /sys$DEVPATH/state
            [ "$state" = offline ] && echo online_movable > /sys$DEVPATH/state 2>/dev/null ;;
    esac
    case "$SUBSYSTEM" in cpu|memory) report_size ;; esac
    exit 0
fi

/bin/busybox mkdir -p /proc /sys /dev /mnt /tmp
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev
/bin/busybox --install -s /bin
export PATH=/bin

for m in virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci \
         virtio_blk virtio_console qemu_fw_cfg evdev button; do
    [ -f /lib/modules/$m.ko ] && insmod /lib/modules/$m.ko 2>/dev/null
done

mode=powerdown
for word in $(cat /proc/cmdline); do
    case "$word" in neonvm.test=*) mode=${word#neonvm.test=} ;; esac
done
for word in $(cat /proc/cmdline); do  # again, now that /proc is mounted
    case "$word" in neonvm.cpu_scaling=sysfs) cpu_scaling=sysfs ;; esac
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

# Online any CPU that is present but offline (a DIMM or vCPU plugged before the
# listener started), then listen for hot-plug events.
if [ $cpu_scaling = qmp ]; then
    for c in /sys/devices/system/cpu/cpu[0-9]*; do
        [ -f $c/online ] && [ "$(cat $c/online)" = 0 ] && echo 1 > $c/online
    done
else
    sysfs_agent &
fi
uevent /init --neonvm-hotplug &
report_size

echo "$marker"

case "$mode" in
    poweroff) echo "guest: powering off on my own"; poweroff -f ;;
    panic) echo "guest: crashing"; echo c > /proc/sysrq-trigger ;;
esac

while true; do sleep 3600; done
