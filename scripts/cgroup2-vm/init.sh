#!/bin/sh
# PID 1 of the cgroup2 test guest (busybox sh, inside the initramfs that
# mkinitramfs.py builds). It mounts the host's root (9p, read-only) with a tmpfs
# overlay on top, a cgroup2-only /sys/fs/cgroup, fresh tmpfs state dirs and the
# exchange dir at its host path, switch_roots into it, runs the command run.sh left
# in the exchange dir as root, writes its exit status to EXCHANGE/rc and powers off
# (VM_MODE=systemd: execs systemd instead, which runs the command as a unit).
# Settings come from EXCHANGE/.cgroup2-vm/config (written by run.sh).
if [ "$1" = stage2 ]; then
    # Stage 2, after switch_root: PID 1 with the host's root as the real root (not a
    # chroot: the kernel refuses CLONE_NEWUSER to chrooted processes, and nsjail needs it).
    BB=/run/cgroup2-vm/busybox
    cd /
    if [ "$VM_MODE" = systemd ]; then
        # systemd as PID 1 instead: the command runs as a unit once the boot is up.
        # run.sh left the guest's additions to /etc (units, masks, daemon.json) in the
        # exchange dir (systemd-guest.sh). /.dockerenv is the host's (a Docker container):
        # seeing it, systemd would take this guest for a container too.
        $BB cp -a "$VM_EXCHANGE/.cgroup2-vm/etc/." /etc/ && $BB rm -f /.dockerenv &&
            exec /lib/systemd/systemd --unit=cgroup2-vm.target
        $BB echo "cgroup2-vm: FATAL: cannot set up or exec systemd"
        $BB poweroff -f
        $BB echo o >/proc/sysrq-trigger
        exit 1
    fi
    $BB echo "cgroup2-vm: exec: $($BB cat "$VM_EXCHANGE/.cgroup2-vm/cmd.argv" 2>/dev/null)"
    {
        /usr/bin/env -i /bin/sh "$VM_EXCHANGE/.cgroup2-vm/cmd.sh" </dev/null
        $BB echo $? >/run/cgroup2-vm/rc
    } 2>&1 | $BB tee "$VM_EXCHANGE/output.log"
    rc=$($BB cat /run/cgroup2-vm/rc 2>/dev/null)
    $BB echo "cgroup2-vm: command exited with status ${rc:-?}"
    [ -n "$rc" ] && $BB echo "$rc" >"$VM_EXCHANGE/rc"
    $BB sync
    $BB poweroff -f
    $BB echo o >/proc/sysrq-trigger
    exit 1
fi

export PATH=/bin
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

say() { echo "cgroup2-vm: $*"; }
die() {
    say "FATAL: $*"
    sync
    poweroff -f
    echo o >/proc/sysrq-trigger
    exit 1 # PID 1 exiting panics; with panic=-1 and -no-reboot qemu then exits
}
T0=$(cut -d' ' -f1 /proc/uptime)

while read -r m; do
    insmod "/modules/$m.ko" || die "insmod $m failed"
done </modules/load

mount9p() { # TAG DIR OPTIONS: retried briefly, in case the virtio device is still being probed
    i=0
    until mount -t 9p -o "trans=virtio,version=9p2000.L,$3" "$1" "$2" 2>/tmp/mount.err; do
        i=$((i + 1))
        [ $i -ge 50 ] && { cat /tmp/mount.err; return 1; }
        usleep 100000
    done
}

mount9p exchange /exchange "msize=262144,cache=none,access=client" || die "cannot mount the exchange dir (9p tag 'exchange')"
[ -r /exchange/.cgroup2-vm/config ] || die "no /exchange/.cgroup2-vm/config"
. /exchange/.cgroup2-vm/config
VM_DIR=/exchange/.cgroup2-vm

# The host's root, read-only (qemu exports it readonly=on as well).
if [ "$VM_ROOT_MODE" = overlay ]; then
    mkdir -p /lower /ovl
    mount9p hostroot /lower "ro,$VM_ROOT_OPTS" || die "cannot mount the host root (9p tag 'hostroot')"
    mount -t tmpfs -o mode=755 tmpfs /ovl
    mkdir -p /ovl/upper /ovl/work
    mount -t overlay -o lowerdir=/lower,upperdir=/ovl/upper,workdir=/ovl/work overlay /newroot ||
        die "cannot mount the overlay root"
else
    mount9p hostroot /newroot "ro,$VM_ROOT_OPTS" || die "cannot mount the host root (9p tag 'hostroot')"
fi
R=/newroot

mount -t proc proc $R/proc || die "mount proc"
mount -t sysfs sysfs $R/sys || die "mount sysfs"
mount -t devtmpfs devtmpfs $R/dev || die "mount devtmpfs"
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666,mode=620,gid=5 devpts $R/dev/pts
ln -sf pts/ptmx $R/dev/ptmx 2>/dev/null
mount -t tmpfs -o mode=1777 tmpfs $R/dev/shm
ln -sf /proc/self/fd $R/dev/fd 2>/dev/null
mount -t cgroup2 -o nsdelegate cgroup2 $R/sys/fs/cgroup || die "mount cgroup2"

# The caller's working directory (the repo) stays visible even where a fresh tmpfs
# covers its parent (a clone in /tmp): held aside now, put back after the tmpfs mounts.
i=0
for d in $VM_KEEP; do
    [ -d "$R$d" ] || continue
    mkdir -p "/keep/$i" && mount --bind "$R$d" "/keep/$i" && echo "$d" >"/keep/$i.path" || die "cannot hold $d"
    i=$((i + 1))
done

# Empty, writable state dirs (a fresh boot's /tmp and /run; no daemon state of the host's).
for d in $VM_TMPFS; do
    mkdir -p "$R$d" 2>/dev/null
    if [ -d "$R$d" ]; then
        case $d in /tmp | /var/tmp) o=mode=1777 ;; *) o=mode=755 ;; esac
        mount -t tmpfs -o "$o" tmpfs "$R$d" || say "warning: tmpfs on $d failed"
    else
        say "warning: $d does not exist on the host's read-only root: not mounted"
    fi
done
for p in /keep/*.path; do
    [ -e "$p" ] || continue
    d=$(cat "$p")
    mkdir -p "$R$d" && mount --bind "${p%.path}" "$R$d" || die "cannot put $d back"
done

# Writable copies of host dirs that must keep their content (ro mode only: in overlay
# mode everything is already writable). /root holds /root/.pyenv, the venv's python.
if [ "$VM_ROOT_MODE" != overlay ]; then
    for d in $VM_COW; do
        [ -d "$R$d" ] || continue
        n=$(echo "$d" | tr / _)
        mkdir -p "/cow/$n" && mount -t tmpfs -o mode=755 tmpfs "/cow/$n" && mkdir "/cow/$n/u" "/cow/$n/w" &&
            mount -t overlay -o "lowerdir=$R$d,upperdir=/cow/$n/u,workdir=/cow/$n/w" overlay "$R$d" ||
            say "warning: writable overlay on $d failed"
    done
fi

# The exchange dir at the path it has on the host.
mkdir -p "$R$VM_EXCHANGE" 2>/dev/null
mount --bind /exchange "$R$VM_EXCHANGE" || die "cannot mount the exchange dir at $VM_EXCHANGE"

# The guest kernel's modules (from run.sh's cache, on the host root): loadable with
# busybox modprobe from here, and visible as /lib/modules/<ver> inside when writable.
KVER=$(uname -r)
if [ -n "$VM_MODULES_DIR" ] && [ -d "$R$VM_MODULES_DIR" ]; then
    mkdir -p /lib/modules && ln -s "$R$VM_MODULES_DIR" "/lib/modules/$KVER"
    if mkdir -p "$R/lib/modules/$KVER" 2>/dev/null; then
        mount --bind "$R$VM_MODULES_DIR" "$R/lib/modules/$KVER"
    fi
    for m in $VM_EXTRA_MODULES; do
        modprobe "$m" || say "warning: modprobe $m failed"
    done
fi

# cgroup2: hand the controllers down from the root.
for c in $VM_CONTROLLERS; do
    echo "+$c" >$R/sys/fs/cgroup/cgroup.subtree_control || say "warning: cannot enable the $c controller"
done

hostname cgroup2-vm
ip link set lo up 2>/dev/null || ifconfig lo 127.0.0.1 up

T1=$(cut -d' ' -f1 /proc/uptime)
say "guest ready: kernel $KVER, uptime ${T1}s (init took $(echo "$T1 $T0" | awk '{printf "%.2f", $1 - $2}')s)"
mkdir -p $R/run/cgroup2-vm && cp /bin/busybox /init $R/run/cgroup2-vm/ || die "cannot stage into $R/run"
export VM_EXCHANGE VM_MODE
exec switch_root $R /run/cgroup2-vm/busybox sh /run/cgroup2-vm/init stage2
die "switch_root failed"
