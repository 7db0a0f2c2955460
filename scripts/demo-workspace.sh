#!/usr/bin/env bash
# demo-workspace.sh - the README quick start's workspace, made if missing (idempotent).
#
# A call's workspace must be a directory strictly below one of the daemon's workspace
# roots (by default /home and /srv/sandboxd/workspaces), and its command runs as the
# workspace's owner: a workspace owned by root (user or group) is refused unless the
# daemon's config names root_workspace_uid/gid. So the demo workspace gets an owner of
# its own, an unprivileged system user with no login and no home, made here if missing.
#
# A workspace that already exists and is owned by another non-root user is left as it
# is (it is a valid workspace: the sandbox runs as that user); one owned by root is
# handed to the demo user (the directory itself, never its contents).
#
# Needs root. Prints the workspace's path on stdout.
# Environment:
#   SANDBOXD_DEMO_WORKSPACE  the directory (default /srv/sandboxd/workspaces/demo)
#   SANDBOXD_DEMO_USER       its owner (default sandboxd-demo)
set -euo pipefail

WORKSPACE="${SANDBOXD_DEMO_WORKSPACE:-/srv/sandboxd/workspaces/demo}"
DEMO_USER="${SANDBOXD_DEMO_USER:-sandboxd-demo}"

log() { printf 'demo-workspace: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ "$(id -u)" -eq 0 ] || die "needs root (it may add the user $DEMO_USER and chown $WORKSPACE)"
case "$WORKSPACE" in
    /*) ;;
    *) die "SANDBOXD_DEMO_WORKSPACE must be an absolute path, not $WORKSPACE" ;;
esac

if ! getent passwd "$DEMO_USER" >/dev/null; then
    log "adding the system user $DEMO_USER (no login, no home)"
    useradd --system --user-group --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin --comment "sandboxd demo workspace owner" "$DEMO_USER"
fi
uid="$(id -u "$DEMO_USER")"
gid="$(id -g "$DEMO_USER")"
[ "$uid" -ne 0 ] && [ "$gid" -ne 0 ] || die "$DEMO_USER is uid $uid gid $gid: the sandbox never runs as root"

parent="$(dirname "$WORKSPACE")"
if [ ! -d "$parent" ]; then
    # Root's and not writable by others: nobody else may plant a workspace or a link there.
    install -d -m 0755 -o root -g root "$parent"
fi
[ ! -L "$WORKSPACE" ] || die "$WORKSPACE is a symlink; the daemon resolves links and may refuse it: remove it"

if [ ! -e "$WORKSPACE" ]; then
    install -d -m 0755 -o "$uid" -g "$gid" "$WORKSPACE"
    log "made $WORKSPACE, owned by $DEMO_USER ($uid:$gid)"
elif [ ! -d "$WORKSPACE" ]; then
    die "$WORKSPACE exists and is not a directory"
else
    read -r owner group < <(stat -c '%u %g' "$WORKSPACE")
    if [ "$owner" -eq 0 ] || [ "$group" -eq 0 ]; then
        chown -h "$uid:$gid" "$WORKSPACE"
        log "$WORKSPACE was root's: now owned by $DEMO_USER ($uid:$gid)"
    elif [ "$owner" -ne "$uid" ]; then
        log "$WORKSPACE is owned by uid $owner gid $group: left as it is (the sandbox runs as them)"
    fi
fi
printf '%s\n' "$WORKSPACE"
