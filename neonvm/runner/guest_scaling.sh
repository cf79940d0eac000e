#!/bin/busybox sh
# The guest side of live scaling (docs/runner.md, "Live scaling", "What the guest must
# do"), busybox only. One file for every guest init of this project, installed in the
# guest as /lib/neonvm/guest-scaling.sh:
#   - the runner's init (guest_init.sh beside this file; initramfs.py packs both), for a
#     VM with a command;
#   - the tests' guest init (tests/guest/init.sh; tests/guest/build.py and rootfs.py
#     copy this file next to it).
#
# Run it with /proc, /sys and /dev mounted and virtio_console loaded:
#   guest-scaling.sh start    QmpScaling: online the vCPUs that are present but offline;
#                             SysfsScaling: start the agent. Then start the hotplug
#                             listener (busybox uevent), the MemTotal watcher, and print
#                             one size report. Returns at once; the listeners stay in the
#                             background.
#   guest-scaling.sh hotplug  what uevent runs for each kernel uevent (SUBSYSTEM, ACTION
#                             and DEVPATH in the environment): a hot-added vCPU is onlined
#                             (QmpScaling; x86 kernels leave it offline), a hot-added
#                             memory block still offline is onlined movable (the runner
#                             also passes memhp_default_state=...), and after every cpu
#                             or memory event the guest reports its size.
# The MemTotal watcher reports the size whenever MemTotal changed (checked every 0.2 s):
# virtio-mem plugs and unplugs 8 MiB blocks inside a memory block (128 MiB on x86) that
# is already online, which raises no uevent.
#   guest-scaling.sh report   print the size report once.
# The report, on the console, is the line the runner parses:
#   neonvm-guest-size: cpus=N online=LIST memtotal-kb=K
# Removal needs nothing from here: on ACPI eject the kernel offlines the CPU or memory
# block itself, then QEMU drops the device; virtio-mem's driver (virtio_mem, loaded by
# the init) offlines and gives back what the runner asks for by itself.
#
# SysfsScaling (neonvm.cpu_scaling=sysfs and maxcpus=USE on the kernel command line): all
# vCPUs are present, USE of them online. The agent reads "cpus N" lines from the
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

mem_total() {
    while read key value unit; do
        [ "$key" = MemTotal: ] && echo $value && return
    done < /proc/meminfo
}

watch_mem_total() {
    last=$(mem_total)
    while sleep 0.2; do
        now=$(mem_total)
        [ "$now" = "$last" ] && continue
        last=$now
        report_size
    done
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
        echo "neonvm-scaling: no vm.neon.tech.agent port: SysfsScaling agent not started"
        return
    fi
    echo "neonvm-scaling: SysfsScaling agent on $port"
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

case "$1" in
    hotplug)
        case "$SUBSYSTEM:$ACTION" in
            cpu:add)
                [ $cpu_scaling = qmp ] && [ -f /sys$DEVPATH/online ] \
                    && echo 1 > /sys$DEVPATH/online 2>/dev/null ;;
            memory:add)
                read state < /sys$DEVPATH/state
                [ "$state" = offline ] && echo online_movable > /sys$DEVPATH/state 2>/dev/null ;;
        esac
        case "$SUBSYSTEM" in cpu|memory) report_size ;; esac
        ;;
    start)
        # Online any CPU that is present but offline (plugged before the listener
        # started), then listen for hot-plug events.
        if [ $cpu_scaling = qmp ]; then
            for c in /sys/devices/system/cpu/cpu[0-9]*; do
                [ -f $c/online ] && [ "$(cat $c/online)" = 0 ] && echo 1 > $c/online
            done
        else
            sysfs_agent &
        fi
        uevent /bin/busybox sh "$0" hotplug &
        watch_mem_total &
        echo "neonvm-scaling: listening for cpu and memory hotplug ($cpu_scaling)"
        report_size
        ;;
    report)
        report_size
        ;;
    *)
        echo "usage: $0 start|hotplug|report" >&2
        exit 2
        ;;
esac
exit 0
