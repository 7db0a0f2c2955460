#!/bin/sh
# The --systemd mode of the cgroup2 test guest, in two steps:
#
#   etc DIR  on the host (run.sh, DIR = EXCHANGE/.cgroup2-vm/etc): writes the guest-only
#            additions to /etc: the boot target, the command's unit, masks for what is
#            useless or slow here, dockerd's daemon.json, the hostname. init.sh's stage 2
#            copies DIR over the guest's /etc (the overlay root: guest RAM; the host's root
#            is exported and mounted read-only) and execs systemd as PID 1. Written on the
#            host because under TCG the guest pays ~0.1 s per fork+exec.
#   run      in the guest, ExecStart= of cgroup2-vm-command.service (from the copy run.sh
#            leaves in EXCHANGE/.cgroup2-vm/): runs the command as the plain mode's stage
#            2 does (clean env, output to the console and EXCHANGE/output.log, status to
#            EXCHANGE/rc), then powers the guest off at once.
set -u
VMD=${0%/*}
BB=/run/cgroup2-vm/busybox
TARGET=cgroup2-vm.target
COMMAND_UNIT=cgroup2-vm-command.service

# Units that are useless in this guest (no network device, no logins, nothing persists)
# or slow under TCG. Unit templates (name@.service) mask all their instances.
MASKED="
    getty.target getty@.service serial-getty@.service console-getty.service
    container-getty@.service getty-static.service autovt@.service
    systemd-networkd.service systemd-networkd.socket systemd-networkd-wait-online.service
    systemd-resolved.service systemd-timesyncd.service systemd-time-wait-sync.service
    NetworkManager.service NetworkManager-wait-online.service networking.service
    ifupdown-wait-online.service nftables.service
    apt-daily.service apt-daily-upgrade.service man-db.service dpkg-db-backup.service
    e2scrub_all.service e2scrub_reap.service fstrim.service logrotate.service
    systemd-tmpfiles-clean.service cron.service ssh.service postgresql.service
    packagekit.service polkit.service systemd-logind.service systemd-user-sessions.service
    apparmor.service systemd-pstore.service systemd-binfmt.service
    proc-sys-fs-binfmt_misc.automount proc-sys-fs-binfmt_misc.mount
    sys-fs-fuse-connections.mount sys-kernel-config.mount sys-kernel-debug.mount
    sys-kernel-tracing.mount dev-hugepages.mount
    systemd-firstboot.service systemd-machine-id-commit.service systemd-modules-load.service
    systemd-pcrphase.service systemd-pcrphase-sysinit.service systemd-random-seed.service
    systemd-repart.service systemd-sysusers.service systemd-update-utmp.service
    systemd-update-utmp-runlevel.service systemd-remount-fs.service
    systemd-fsck-root.service systemd-hwdb-update.service systemd-journal-catalog-update.service
    systemd-update-done.service ldconfig.service systemd-journal-flush.service
    systemd-tmpfiles-setup-dev.service systemd-sysctl.service
    emergency.service rescue.service debug-shell.service
"

mask_units() {
    mkdir -p "$UNITS" "$ETC/systemd/system-generators" || return 1
    for u in $MASKED; do
        ln -sfn /dev/null "$UNITS/$u" || return 1
    done
    # Every enabled timer (apt, man-db, e2scrub, fstrim, ...): whatever the host has.
    for t in /etc/systemd/system/timers.target.wants/* /lib/systemd/system/timers.target.wants/*; do
        [ -e "$t" ] || [ -L "$t" ] || continue
        ln -sfn /dev/null "$UNITS/${t##*/}" || return 1
    done
    # No generator is of use here (an empty fstab, no crypt/gpt/sysv/getty/rc-local setup
    # wanted), and under TCG each costs a fork+exec at every boot and daemon-reload.
    for g in /lib/systemd/system-generators/* /usr/lib/systemd/system-generators/*; do
        [ -e "$g" ] || continue
        ln -sfn /dev/null "$ETC/systemd/system-generators/${g##*/}" || return 1
    done
}

write_units() {
    # The boot's goal: basic.target (sysinit, sockets, slices) and the command. Not
    # multi-user.target, which would start every service the host has enabled (docker,
    # containerd, ...): the command starts what it needs itself.
    cat >"$UNITS/$TARGET" <<EOF || return 1
[Unit]
Description=cgroup2-vm: the boot, then the command
Requires=basic.target
Wants=$COMMAND_UNIT
After=basic.target
AllowIsolate=yes
# A boot that never gets to the command powers off rather than waiting for run.sh's timeout.
JobTimeoutSec=${CGROUP2_VM_BOOT_TIMEOUT:-600}
JobTimeoutAction=poweroff-immediate
EOF
    # No default dependencies: the command starts after basic.target whatever became of
    # it (Wants=, not Requires=), and an isolate (emergency.target) leaves it running.
    cat >"$UNITS/$COMMAND_UNIT" <<EOF || return 1
[Unit]
Description=cgroup2-vm: the command (scripts/cgroup2-vm/run.sh)
DefaultDependencies=no
Wants=sysinit.target basic.target
After=sysinit.target basic.target
Conflicts=shutdown.target
Before=shutdown.target
IgnoreOnIsolate=yes
# "run" powers off itself once the status is written; these only act if it is killed.
SuccessAction=poweroff-immediate
FailureAction=poweroff-immediate

[Service]
Type=exec
ExecStart=/bin/sh $VM_EXCHANGE/.cgroup2-vm/systemd-guest.sh run
Environment=VM_EXCHANGE=$VM_EXCHANGE
User=root
StandardInput=null
StandardOutput=tty
StandardError=inherit
TTYPath=/dev/console
TimeoutStartSec=infinity
EOF
}

write_docker_config() {
    # dockerd with the systemd cgroup driver, only lo (no bridge, no iptables), its state
    # on the fresh tmpfs run.sh mounts on /var/lib/docker (and /var/lib/containerd).
    mkdir -p "$ETC/docker" || return 1
    cat >"$ETC/docker/daemon.json" <<EOF
{
    "exec-opts": ["native.cgroupdriver=systemd"],
    "bridge": "none",
    "iptables": false,
    "ip-forward": false,
    "ip-masq": false,
    "data-root": "/var/lib/docker",
    "storage-driver": "${CGROUP2_VM_DOCKER_STORAGE:-overlay2}"
}
EOF
}

write_etc() { # DIR: VM_EXCHANGE must be set
    ETC=$1
    UNITS=$ETC/systemd/system
    rm -rf "$ETC" && mkdir -p "$UNITS" || return 1
    mask_units && write_units && write_docker_config || return 1
    # An empty or missing machine-id would make this a "first boot" (preset-all, firstboot).
    if ! grep -qE '^[0-9a-f]{32}$' /etc/machine-id 2>/dev/null; then
        tr -d '-' </proc/sys/kernel/random/uuid >"$ETC/machine-id" || return 1
    fi
    echo cgroup2-vm >"$ETC/hostname"
}

run() {
    cd /
    $BB echo "cgroup2-vm: exec: $($BB cat "$VMD/cmd.argv" 2>/dev/null)"
    {
        /usr/bin/env -i /bin/sh "$VMD/cmd.sh" </dev/null
        $BB echo $? >/run/cgroup2-vm/rc
    } 2>&1 | $BB tee "$VM_EXCHANGE/output.log"
    rc=$($BB cat /run/cgroup2-vm/rc 2>/dev/null)
    $BB echo "cgroup2-vm: command exited with status ${rc:-?}"
    [ -n "$rc" ] && $BB echo "$rc" >"$VM_EXCHANGE/rc"
    $BB sync
    $BB poweroff -f
    $BB echo o >/proc/sysrq-trigger
    exit 1
}

case ${1:-} in
etc) [ $# = 2 ] && [ -n "${VM_EXCHANGE:-}" ] || { echo "usage: VM_EXCHANGE=DIR $0 etc DIR" >&2; exit 2; }
    write_etc "$2" ;;
run) run ;;
*) echo "usage: $0 etc DIR | run" >&2; exit 2 ;;
esac
