#!/bin/busybox sh
# /init of the runner's initramfs (neonvm/runner/initramfs.py builds it into /vm/kernel
# of the runner image). It boots NeonVM-style root disks: one bare ext4 filesystem with
# the guest's programs, no kernel and no boot loader.
#
# 1. Mount /proc, /sys, /dev; load the modules listed in /lib/modules/load-order.
# 2. Source the runner's boot script from fw_cfg (opt/vm.neon.tech/boot.sh): the marker,
#    sysctls, swap, disks, env and command, as variables and functions. Every value
#    in it is single-quoted by the runner.
# 3. Mount the root disk (virtio serial "rootdisk") on /newroot and grow its filesystem to
#    the disk's size (resize2fs, online: rootDisk.size makes the disk larger than the
#    image). With init=... on the kernel command line (the runner puts
#    init=/neonvm/bin/init there for a vm-builder image): hand over to that init at once
#    (switch_root); the image's init reads the runner's runtime disk itself
#    (docs/runner.md, "The vm-builder boot contract"). Otherwise bring up the network
#    (QEMU user networking: 10.0.2.15/24, gateway 10.0.2.2, DNS 10.0.2.3), apply the
#    sysctls, turn the swap disk on, mount the extra disks and tmpfs mounts.
# 4. With a command: start the guest side of live scaling (/lib/neonvm/guest-scaling.sh,
#    neonvm/runner/guest_scaling.sh: it onlines hot-added vCPUs, runs the SysfsScaling
#    agent, onlines offline DIMM blocks and reports the guest's size on the console),
#    run the command chrooted into /newroot with the spec's env, its output on
#    the serial console, then print the ready marker. This shell stays PID 1: on the
#    ACPI power button it sends the command SIGTERM (SIGKILL 20 s later); when the
#    command ends the machine powers off (exit 0, or stopped by the button) or reboots
#    (any other exit code; the runner's -no-reboot makes that a failed VM).
#    Without a command: hand over to the root filesystem's /sbin/init (switch_root);
#    that init prints the marker itself, and live scaling's guest side is its business
#    (nothing of this initramfs keeps running).

/bin/busybox mkdir -p /proc /sys /dev /run /tmp /newroot
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sysfs /sys
/bin/busybox mount -t devtmpfs devtmpfs /dev
/bin/busybox --install -s /bin
export PATH=/bin

say() { echo "neonvm-init: $*"; }

halt_now() {
    # $1: poweroff or reboot. PID 1 must never exit (that is a kernel panic).
    sync
    swapoff -a 2>/dev/null
    umount -r /newroot 2>/dev/null
    sync
    "$1" -f
    while true; do sleep 3600; done
}

fail() {
    say "error: $*"
    halt_now reboot
}

while read -r m; do
    insmod "/lib/modules/$m" 2>/dev/null
done < /lib/modules/load-order

boot=/sys/firmware/qemu_fw_cfg/by_name/opt/vm.neon.tech/boot.sh/raw
[ -r "$boot" ] || fail "no boot script in fw_cfg (opt/vm.neon.tech/boot.sh)"
. "$boot"

disk_by_serial() {
    for d in /sys/block/vd*; do
        [ -e "$d" ] || continue
        if [ "$(cat "$d/serial" 2>/dev/null)" = "$1" ]; then
            echo "/dev/${d##*/}"
            return 0
        fi
    done
    return 1
}

root=
for i in $(seq 50); do
    root=$(disk_by_serial rootdisk) && break
    sleep 0.1
done
[ -n "$root" ] || fail "no root disk (a virtio disk with serial rootdisk)"
mount -t ext4 -o rw "$root" /newroot || fail "cannot mount $root (ext4) on /newroot"
say "root filesystem $root mounted"
if [ -x /bin/resize2fs ]; then
    # Online grow; "Nothing to do" when the disk is no larger than the filesystem.
    if out=$(resize2fs "$root" 2>&1); then
        say "root filesystem: $(echo "$out" | grep -E 'is now|Nothing to do' | tail -n 1)"
    else
        say "root filesystem not grown: $(echo "$out" | tail -n 1)"
    fi
fi
for d in proc sys dev tmp run; do mkdir -p "/newroot/$d"; done

guest_init=
for word in $(cat /proc/cmdline); do
    case "$word" in init=*) guest_init=${word#init=} ;; esac
done
if [ -n "$guest_init" ]; then
    if [ -e "/newroot$guest_init" ] || [ -L "/newroot$guest_init" ]; then
        say "handing over to $guest_init of the root filesystem (vm-builder image)"
        # As a kernel without initramfs would: /dev mounted (devtmpfs), /proc and /sys
        # left to the image's init (vminit mounts them).
        mount --move /dev /newroot/dev
        umount /sys
        umount /proc
        exec switch_root /newroot "$guest_init"
    fi
    fail "init=$guest_init is not in the root filesystem"
fi

if [ -e /sys/class/net/eth0 ]; then
    ip link set lo up
    ip link set eth0 up
    ip addr add 10.0.2.15/24 dev eth0
    ip route add default via 10.0.2.2
    if [ -d /newroot/etc ] && [ ! -s /newroot/etc/resolv.conf ] && [ ! -L /newroot/etc/resolv.conf ]; then
        echo "nameserver 10.0.2.3" > /newroot/etc/resolv.conf
    fi
fi

neonvm_sysctl() {
    if sysctl -w "$1=$2" > /dev/null; then
        say "sysctl $1=$(sysctl -n "$1")"
    else
        say "sysctl $1=$2 failed"
    fi
}
neonvm_sysctls

if [ -n "$NEONVM_SWAP_SERIAL" ]; then
    swap=$(disk_by_serial "$NEONVM_SWAP_SERIAL")
    if [ -n "$swap" ] && mkswap "$swap" > /dev/null && swapon "$swap"; then
        say "swap on $swap: $(grep SwapTotal /proc/meminfo | tr -s ' ')"
    else
        say "swap disk $NEONVM_SWAP_SERIAL could not be turned on"
    fi
fi

neonvm_mount_disk() {
    dev=$(disk_by_serial "$1") || { say "disk $1 not found"; return; }
    mkdir -p "/newroot$2"
    mount -t ext4 -o "$3" "$dev" "/newroot$2" && say "disk $1 mounted on $2 ($3)"
}
neonvm_mount_tmpfs() {
    mkdir -p "/newroot$1"
    if [ -n "$2" ]; then opts="size=$2"; else opts=defaults; fi
    mount -t tmpfs -o "$opts" tmpfs "/newroot$1" && say "tmpfs mounted on $1"
}
neonvm_mounts

if [ "$NEONVM_HAS_COMMAND" != 1 ]; then
    if [ -e /newroot/sbin/init ] || [ -L /newroot/sbin/init ]; then
        say "no command: handing over to /sbin/init of the root filesystem"
        for d in proc sys dev; do mount --move "/$d" "/newroot/$d"; done
        exec switch_root /newroot /sbin/init
    fi
    fail "no command in the spec and no /sbin/init in the root filesystem"
fi

mount --bind /proc /newroot/proc
mount --bind /sys /newroot/sys
mount --bind /dev /newroot/dev

# Live scaling, from this initramfs (not the root filesystem): its listeners run beside
# the command for the VM's life.
sh /lib/neonvm/guest-scaling.sh start

(
    export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/
    neonvm_env
    neonvm_exec
) < /dev/console > /dev/console 2>&1 &
pid=$!
say "command started (pid $pid)"

# The power button: the event device is opened here, before the marker, so a press that
# follows the marker waits in evdev's queue instead of being lost.
fd=3
for d in /sys/class/input/event*; do
    [ "$(cat "$d/device/name" 2>/dev/null)" = "Power Button" ] || continue
    eval "exec $fd</dev/input/${d##*/}"
    (
        eval "dd of=/dev/null bs=24 count=1 <&$fd" 2>/dev/null
        : > /run/stopping
        say "power button pressed: stopping the command"
        kill -TERM "$pid" 2>/dev/null
        sleep 20
        kill -KILL "$pid" 2>/dev/null
    ) &
    fd=$((fd + 1))
done

echo "$NEONVM_MARKER"

wait "$pid"
code=$?
if [ -e /run/stopping ] || [ "$code" = 0 ]; then
    say "command exited with code $code: powering off"
    halt_now poweroff
fi
say "command exited with code $code: rebooting (the VM fails)"
halt_now reboot
