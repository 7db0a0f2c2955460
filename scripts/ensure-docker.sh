#!/usr/bin/env bash
# ensure-docker.sh - make sure a working Docker daemon is reachable.
#
# Idempotent.  Safe to run from make/CI as root without systemd and without a
# tty/stdin:
#   1. install what is missing: Debian's docker.io, debootstrap and busybox-static
#      (images/build.sh), tini (the nsjail backend's init);
#   2. if `docker info` works, done;
#   3. start dockerd fully detached (setsid + nohup) so it outlives the
#      calling make, and wait up to DOCKER_WAIT_SECS (60) for `docker info`.
#
# Environment:
#   DOCKER_WAIT_SECS      seconds to wait for the daemon (default 60)
#   SANDBOXD_DOCKERD_LOG  dockerd log file (default /var/log/sandboxd-dockerd.log)
set -euo pipefail

WAIT_SECS="${DOCKER_WAIT_SECS:-60}"
LOG="${SANDBOXD_DOCKERD_LOG:-/var/log/sandboxd-dockerd.log}"

log() { printf 'ensure-docker: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

docker_ok() {
    command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1
}

# --- packages ---------------------------------------------------------------
pkgs=()
command -v dockerd >/dev/null 2>&1 || pkgs+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || pkgs+=(debootstrap)
# images/build.sh needs the *static* busybox binary from busybox-static.
dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q 'install ok installed' \
    || pkgs+=(busybox-static)
# The nsjail backend runs the static tini as each jail's PID 1.
[ -x /usr/bin/tini-static ] || pkgs+=(tini)
# tests/integration/test_sdnotify.py runs `systemd-analyze verify` on the unit (systemd is not started).
command -v systemd-analyze >/dev/null 2>&1 || pkgs+=(systemd)

if docker_ok && [ "${#pkgs[@]}" -eq 0 ]; then
    exit 0
fi

# Everything below (apt-get, starting dockerd) needs root.
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || die "docker is not up and this needs root (no sudo)"
    exec sudo -n --preserve-env=DOCKER_WAIT_SECS,SANDBOXD_DOCKERD_LOG,DOCKER_HOST bash "$0" "$@"
fi

if [ "${#pkgs[@]}" -gt 0 ]; then
    log "installing: ${pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q </dev/null
    # docker.io's maintainer scripts try to start the service; without
    # systemd that may fail or start it via its init.d script.  Either way is
    # fine: we (re)check below and start dockerd ourselves if needed.
    apt-get install -y -q "${pkgs[@]}" </dev/null
fi

command -v dockerd >/dev/null 2>&1 || die "dockerd still missing after install"
command -v docker >/dev/null 2>&1 || die "docker CLI missing (install docker.io)"

if docker_ok; then
    log "docker is up"
    exit 0
fi

# --- start dockerd ----------------------------------------------------------
if pgrep -x dockerd >/dev/null 2>&1; then
    log "dockerd process exists (pid $(pgrep -x dockerd | tr '\n' ' ')); waiting for it"
else
    log "starting dockerd (log: $LOG)"
    mkdir -p "$(dirname "$LOG")"
    # setsid: own session, so make's SIGHUP/SIGINT on exit does not reach it.
    # nohup + </dev/null: no controlling terminal / stdin needed (CI).
    # The inner bash closes every inherited fd above 2 (e.g. a CI runner's
    # output pipe or make's jobserver) so the daemon never keeps them open.
    # shellcheck disable=SC2016  # $$ must expand in the inner bash
    setsid nohup bash -c '
        for fd in $(ls /proc/$$/fd); do
            [ "$fd" -gt 2 ] && eval "exec $fd>&-"
        done 2>/dev/null
        exec dockerd' >>"$LOG" 2>&1 </dev/null &
    disown || true
fi

for ((i = 0; i < WAIT_SECS; i++)); do
    if docker_ok; then
        log "docker is up after ${i}s"
        exit 0
    fi
    sleep 1
done

log "dockerd did not become ready within ${WAIT_SECS}s; last log lines:"
tail -n 40 "$LOG" >&2 2>/dev/null || true
die "docker info still failing"
