#!/bin/bash
# Runs a command inside a small qemu guest (KVM where the CPU has vmx/svm, else TCG:
# see CGROUP2_VM_ACCEL) whose only cgroup hierarchy is cgroup2, on the host's own
# root filesystem (9p, read-only, with a tmpfs overlay on top). No network device.
#
#   scripts/cgroup2-vm/run.sh [--systemd] [--env NAME=VALUE]... EXCHANGE_DIR -- COMMAND [ARG]...
#   scripts/cgroup2-vm/run.sh --prepare        # only install qemu (and systemd) and build the cache
#
# EXCHANGE_DIR (created if missing) is shared writable with the guest at the same
# path; afterwards it holds output.log (the command's stdout+stderr, which is also
# streamed here) and rc (its exit status). The command runs as root in the guest,
# in the caller's working directory (or / if that is missing there), with
# PATH, HOME=/root, LANG=C.UTF-8, PYTHONDONTWRITEBYTECODE=1 and the --env values.
#
# --systemd: the guest boots the host's systemd as PID 1 and the command runs as the
# unit cgroup2-vm-command.service once basic.target is up (systemd-guest.sh); dockerd is
# not started but configured (systemd cgroup driver, no bridge or iptables, state on a
# fresh tmpfs): `systemctl start docker`. Needs the overlay root mode.
#
# Exit status: the command's, or
#   250  the guest wrote no rc (failed to boot or to set up: see the console output)
#   251  the wall-clock timeout ran out
#   252  bad usage, or the cache could not be built
#
# Environment:
#   CGROUP2_VM_TIMEOUT   wall-clock limit in seconds (1200)
#   CGROUP2_VM_CACHE     cache dir (/var/cache/sandboxd-cgroup2-vm)
#   CGROUP2_VM_MEM       guest memory (3G)          CGROUP2_VM_SMP  guest CPUs (2)
#   CGROUP2_VM_ROOT_MODE overlay (default: the whole root is writable, writes land in
#                        guest RAM) or ro (read-only root; only the tmpfs dirs and
#                        /root are writable)
#   CGROUP2_VM_9P_OPTS   9p options for the root (msize=512000,cache=loose)
#   CGROUP2_VM_MODULES   extra guest kernel modules to load (e.g. "veth tun")
#   CGROUP2_VM_KERNEL_PKG  the linux-image package to use; default: what
#                        linux-image-amd64 depends on, resolved once and kept in the cache
#   CGROUP2_VM_ACCEL     kvm, tcg or auto (default): kvm where the CPU shows vmx/svm,
#                        else tcg. A /dev/kvm without them (here: kvm_pvm, a
#                        paravirtual nested KVM that needs PVM-built guest kernels)
#                        runs a stock kernel only at a crawl, so tcg is used.
#   CGROUP2_VM_VERBOSE=1 show the kernel's boot messages (and systemd's status lines)
#   CGROUP2_VM_BOOT_TIMEOUT  --systemd: seconds the boot may take to reach the command
#                        before the guest powers itself off (600)
#   CGROUP2_VM_DOCKER_STORAGE  --systemd: dockerd's storage driver (overlay2; or vfs)
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${CGROUP2_VM_CACHE:-/var/cache/sandboxd-cgroup2-vm}
TIMEOUT=${CGROUP2_VM_TIMEOUT:-1200}
MEM=${CGROUP2_VM_MEM:-3G}
SMP=${CGROUP2_VM_SMP:-2}
ROOT_MODE=${CGROUP2_VM_ROOT_MODE:-overlay}
P9_OPTS=${CGROUP2_VM_9P_OPTS:-msize=512000,cache=loose}
EXTRA_MODULES=${CGROUP2_VM_MODULES:-}
# Modules the initramfs loads (with their dependencies); everything else comes from
# the cache via CGROUP2_VM_MODULES.
INITRD_MODULES="virtio_pci 9pnet_virtio 9p overlay"
# Empty tmpfs in the guest: a fresh boot's scratch dirs and everything sandboxd keeps state in.
VM_TMPFS="/tmp /run /var/tmp /var/log /var/lib/sandboxd /var/lib/sandboxd-runtime /var/lib/sandboxd-egress"
VM_COW="/root"
VM_CONTROLLERS="cpu memory pids cpuset io"

E_NORC=250 E_TIMEOUT=251 E_SETUP=252
log() { echo "cgroup2-vm: $*" >&2; }
fail() { log "$*"; exit $E_SETUP; }

usage() {
    sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2
    exit $E_SETUP
}

# ---------------------------------------------------------------- the cache
ensure_qemu() {
    command -v qemu-system-x86_64 >/dev/null && return
    log "installing qemu-system-x86"
    apt_install qemu-system-x86
}

ensure_systemd() { # the --systemd guest's PID 1 is the host's systemd
    [ -x /lib/systemd/systemd ] && return
    log "installing systemd"
    apt_install systemd
}

apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >&2 ||
        { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >&2; } ||
        fail "cannot install $*"
}

kernel_pkg() { # the linux-image-6.1.*-amd64 that linux-image-amd64 depends on
    apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}'
}

ensure_kernel() { # sets KTREE (the extracted package) and KVER
    local pkg=${CGROUP2_VM_KERNEL_PKG:-}
    if [ -z "$pkg" ] && [ -s "$CACHE/kernel-pkg" ]; then
        pkg=$(cat "$CACHE/kernel-pkg") # resolved once: a later apt update does not swap it under the tests
    fi
    if [ -z "$pkg" ]; then
        pkg=$(kernel_pkg)
        [ -n "$pkg" ] || { apt-get update -q >&2; pkg=$(kernel_pkg); }
        [ -n "$pkg" ] || fail "cannot resolve linux-image-amd64's kernel package (apt-cache depends linux-image-amd64)"
    fi
    local dir=$CACHE/kernel/$pkg
    if [ ! -e "$dir/.complete" ]; then
        log "downloading and extracting $pkg into $dir"
        rm -rf "$dir" "$dir.tmp" && mkdir -p "$dir.tmp" || fail "cannot create $dir.tmp"
        (cd "$dir.tmp" && apt-get download "$pkg" >&2 2>/dev/null) ||
            { apt-get update -q >&2 && (cd "$dir.tmp" && apt-get download "$pkg" >&2); } ||
            fail "apt-get download $pkg failed"
        dpkg-deb -x "$dir.tmp"/*.deb "$dir.tmp/tree" || fail "dpkg-deb -x failed"
        local kv
        kv=$(ls "$dir.tmp/tree/lib/modules")
        # modules.dep for the guest's (busybox) modprobe; the package ships none.
        /bin/busybox depmod -b "$dir.tmp/tree" "$kv" || fail "depmod failed"
        # The uncompressed ELF kernel: qemu boots it through its PVH entry, which skips
        # the decompressor (seconds under tcg).
        python3 - "$dir.tmp/tree/boot/vmlinuz-$kv" "$dir.tmp/tree/boot/vmlinux-$kv" <<'PY' || fail "cannot extract vmlinux"
import lzma, sys
data = open(sys.argv[1], "rb").read()
i = data.find(b"\xfd7zXZ\x00")
assert i >= 0, "no xz payload in the bzImage"
out = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data[i:])
assert out[:4] == b"\x7fELF", "the xz payload is not an ELF"
open(sys.argv[2], "wb").write(out)
PY
        rm -f "$dir.tmp"/*.deb
        touch "$dir.tmp/.complete" && mv "$dir.tmp" "$dir" || fail "cannot move $dir.tmp"
    fi
    [ -n "${CGROUP2_VM_KERNEL_PKG:-}" ] || [ -s "$CACHE/kernel-pkg" ] || echo "$pkg" >"$CACHE/kernel-pkg"
    KTREE=$dir/tree
    KVER=$(ls "$KTREE/lib/modules")
    VMLINUZ=$KTREE/boot/vmlinux-$KVER
    [ -f "$VMLINUZ" ] || VMLINUZ=$KTREE/boot/vmlinuz-$KVER
    [ -f "$VMLINUZ" ] || fail "no $VMLINUZ"
}

ensure_initrd() { # sets INITRD, keyed by everything that goes into it
    local key
    key=$( { echo "$KTREE $KVER $INITRD_MODULES"; cat "$HERE/init.sh" "$HERE/mkinitramfs.py" /bin/busybox; } |
        sha256sum | cut -c1-16)
    INITRD=$CACHE/initramfs/$KVER-$key.cpio.gz
    if [ ! -s "$INITRD" ]; then
        log "building $INITRD"
        mkdir -p "$CACHE/initramfs"
        local py
        py=$(command -v python3) || fail "python3 is needed to build the initramfs"
        "$py" "$HERE/mkinitramfs.py" "$KTREE" /bin/busybox "$HERE/init.sh" "$INITRD" $INITRD_MODULES ||
            fail "mkinitramfs failed"
        # Older builds (another init.sh, busybox or module list) are dropped once
        # no run can still be about to boot them.
        find "$CACHE/initramfs" -name '*.cpio.gz' ! -name "${INITRD##*/}" -mmin +10 -delete 2>/dev/null
    fi
}

prepare() {
    [ "$(id -u)" = 0 ] || fail "must run as root (KVM, apt, 9p passthrough)"
    [ -x /bin/busybox ] || fail "/bin/busybox (busybox-static) is needed"
    ensure_qemu
    ensure_systemd
    mkdir -p "$CACHE" || fail "cannot create $CACHE"
    exec 9>"$CACHE/.lock"
    flock 9 # one builder at a time; later runs reuse what it built
    ensure_kernel
    ensure_initrd
    exec 9>&-
}

# ---------------------------------------------------------------- arguments
shq() { # POSIX-sh single quoting
    local s
    for s in "$@"; do printf "'%s' " "${s//\'/\'\\\'\'}"; done
}

ENVS=()
MODE=plain
while [ $# -gt 0 ]; do
    case $1 in
    --prepare) prepare; log "cache ready: $VMLINUZ $INITRD"; exit 0 ;;
    --systemd) MODE=systemd; shift ;;
    --env) [ $# -ge 2 ] || usage; [[ $2 == [A-Za-z_]*=* ]] || fail "--env wants NAME=VALUE"; ENVS+=("$2"); shift 2 ;;
    --env=*) ENVS+=("${1#--env=}"); shift ;;
    -h | --help) usage ;;
    --) usage ;;
    -*) log "unknown option $1"; usage ;;
    *) break ;;
    esac
done
[ $# -ge 3 ] && [ "$2" = -- ] || usage
EXCHANGE=$1
shift 2
[[ $EXCHANGE != *,* ]] || fail "the exchange dir's path must not contain a comma (qemu option syntax)"
mkdir -p "$EXCHANGE" && EXCHANGE=$(realpath "$EXCHANGE") || fail "cannot create $EXCHANGE"
[ "$EXCHANGE" != / ] || fail "the exchange dir cannot be /"
[[ $TIMEOUT =~ ^[0-9]+$ ]] || fail "CGROUP2_VM_TIMEOUT must be whole seconds"
case $ROOT_MODE in overlay | ro) ;; *) fail "CGROUP2_VM_ROOT_MODE must be overlay or ro" ;; esac
if [ "$MODE" = systemd ]; then
    # systemd and its generated units, masks and daemon.json want a writable /etc.
    [ "$ROOT_MODE" = overlay ] || fail "--systemd needs CGROUP2_VM_ROOT_MODE=overlay"
    # The exchange path goes into a unit file unquoted.
    [[ $EXCHANGE != *[[:space:]%\$\\\"\']* ]] || fail "--systemd: the exchange dir's path must not contain blanks, quotes, %, \$ or \\"
    VM_TMPFS+=" /var/lib/docker /var/lib/containerd" # dockerd's state: fresh, not the host's
fi

prepare

# ---------------------------------------------------------------- the exchange dir
VMD=$EXCHANGE/.cgroup2-vm
mkdir -p "$VMD" || fail "cannot write to $EXCHANGE"
rm -f "$EXCHANGE/rc" "$EXCHANGE/output.log" "$VMD/started"
{
    echo "VM_EXCHANGE=$(shq "$EXCHANGE")"
    echo "VM_MODE=$MODE"
    echo "VM_ROOT_MODE=$ROOT_MODE"
    echo "VM_ROOT_OPTS=$(shq "$P9_OPTS")"
    echo "VM_TMPFS=$(shq "$VM_TMPFS")"
    echo "VM_COW=$(shq "$VM_COW")"
    echo "VM_CONTROLLERS=$(shq "$VM_CONTROLLERS")"
    echo "VM_KEEP=$(shq "$PWD")" # visible in the guest even below one of VM_TMPFS
    echo "VM_MODULES_DIR=$(shq "$KTREE/lib/modules/$KVER")"
    echo "VM_EXTRA_MODULES=$(shq "$EXTRA_MODULES")"
} >"$VMD/config"
{
    echo "# written by scripts/cgroup2-vm/run.sh; run by the guest's init as /bin/sh in the chroot"
    echo "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 TERM=dumb USER=root LOGNAME=root"
    for e in "${ENVS[@]}"; do echo "export $(shq "$e")"; done
    echo "cd $(shq "$PWD") 2>/dev/null || cd /"
    echo "exec $(shq "$@")"
} >"$VMD/cmd.sh"
printf '%s\n' "$*" >"$VMD/cmd.argv"
if [ "$MODE" = systemd ]; then
    cp "$HERE/systemd-guest.sh" "$VMD/systemd-guest.sh" &&
        VM_EXCHANGE=$EXCHANGE /bin/sh "$HERE/systemd-guest.sh" etc "$VMD/etc" ||
        fail "cannot write the guest's systemd setup into $VMD"
fi

# ---------------------------------------------------------------- boot
ACCEL=${CGROUP2_VM_ACCEL:-auto}
if [ "$ACCEL" = auto ]; then
    if [ -w /dev/kvm ] && grep -qwE 'vmx|svm' /proc/cpuinfo; then ACCEL=kvm; else ACCEL=tcg; fi
fi
case $ACCEL in
kvm) [ -w /dev/kvm ] || fail "/dev/kvm is not usable"; ACCEL_ARGS=(-enable-kvm -cpu "${CGROUP2_VM_CPU:-host}") ;;
tcg) ACCEL_ARGS=(-accel tcg,thread=multi -cpu "${CGROUP2_VM_CPU:-max}") ;;
*) fail "CGROUP2_VM_ACCEL must be kvm, tcg or auto" ;;
esac
APPEND="console=ttyS0 panic=-1 cgroup_no_v1=all rdinit=/init"
[ "${CGROUP2_VM_VERBOSE:-0}" = 1 ] || APPEND+=" quiet loglevel=3"
QEMU=(qemu-system-x86_64 "${ACCEL_ARGS[@]}" -smp "$SMP" -m "$MEM" -machine q35
    -display none -vga none -serial stdio -monitor none -no-reboot -nic none
    -kernel "$VMLINUZ" -initrd "$INITRD" -append "$APPEND"
    -virtfs "local,path=/,mount_tag=hostroot,security_model=passthrough,readonly=on,multidevs=remap"
    -virtfs "local,path=$EXCHANGE,mount_tag=exchange,security_model=passthrough,multidevs=remap")

AWK=(awk)
if [ -z "$(awk -W interactive 'BEGIN { exit 0 }' 2>&1 >/dev/null)" ]; then
    AWK=(awk -W interactive) # mawk: pass each line on at once, not a block at a time
fi
T0=$(date +%s.%N)
# The serial console (like -nographic, without SeaBIOS's VGA text mirrored on it) ends
# lines with \r\n; the first "exec:" line is the command's start.
timeout -k 10 "$TIMEOUT" "${QEMU[@]}" </dev/null 2>&1 |
    "${AWK[@]}" -v started="$VMD/started" '
        { sub(/\r$/, ""); print; fflush() }
        !t && /^cgroup2-vm: exec: / { t = 1; system("date +%s.%N > \"" started "\"") }'
st=("${PIPESTATUS[@]}")
T1=$(date +%s.%N)

if [ "${st[0]}" = 124 ] || [ "${st[0]}" = 137 ]; then
    log "TIMEOUT: the guest ran longer than ${TIMEOUT}s (CGROUP2_VM_TIMEOUT) and was killed"
    exit $E_TIMEOUT
fi
if [ -s "$VMD/started" ]; then
    log "$ACCEL: $(awk -v a="$T0" -v b="$(cat "$VMD/started")" -v c="$T1" \
        'BEGIN {printf "boot to command start %.2fs, command and poweroff %.2fs", b - a, c - b}')"
fi
if [ ! -s "$EXCHANGE/rc" ]; then
    log "FAILED: the guest wrote no $EXCHANGE/rc (qemu exited ${st[0]}): it did not boot or set up; see the console output above"
    exit $E_NORC
fi
rc=$(cat "$EXCHANGE/rc")
[[ $rc =~ ^[0-9]+$ ]] || { log "FAILED: bad rc file content '$rc'"; exit $E_NORC; }
exit "$rc"
