#!/usr/bin/env bash
# images/build.sh NAME - build a sandboxd base image locally and `docker import` it.
#
#   NAME = default | minimal | busybox   (recipe in images/NAME/recipe.sh)
#
# The image is tagged sandboxd/NAME:<hash>, where <hash> is the first 12 hex
# digits of a SHA-256 over this script, every file under images/lib/ (what the
# recipes share), every file under images/NAME/ and any extra inputs the recipe
# declares (e.g. the busybox binary).  If that tag
# already exists in dockerd, nothing is built: sandboxd/NAME:latest is
# (re)pointed at it and the script exits.  The resulting reference
# ("sandboxd/NAME:<hash>") is printed on stdout; progress goes to stderr.
#
# Environment:
#   SANDBOXD_IMAGE_FORCE=1   rebuild even if the tag exists
#   DEBIAN_MIRROR=URL        override the mirror (Debian images)
#   SANDBOXD_IMAGE_DEB_CACHE where downloaded .debs are kept (/var/cache/sandboxd/debootstrap)
#   SOURCE_DATE_EPOCH=N      mtime clamp for the rootfs tarball
#   SANDBOXD_IMAGE_TMPDIR    where the temporary build dir goes (/var/tmp)
#   SANDBOXD_IMAGE_KEEP_OLD=1  keep images built from older recipes
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NAME="${1:-}"

log() { printf 'images/build.sh[%s]: %s\n' "$NAME" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# A recipe is a directory images/NAME/ with a recipe.sh (lib/ is not one).
if ! [[ "$NAME" =~ ^[a-z][a-z0-9-]*$ ]] || [ "$NAME" = lib ] || ! [ -f "$HERE/$NAME/recipe.sh" ]; then
    echo "usage: $0 NAME   (NAME: $(cd "$HERE" && find . -mindepth 2 -maxdepth 2 -name recipe.sh |
        cut -d/ -f2 | LC_ALL=C sort | paste -sd'|' -))" >&2
    exit 2
fi
RECIPE_DIR="$HERE/$NAME"

# Recipe API (images/NAME/recipe.sh is sourced):
#   recipe_extra_inputs        print extra hash input lines (optional)
#   recipe_build ROOTFS        populate the (empty, existing) dir ROOTFS
#   IMPORT_CHANGES=(...)       Dockerfile instructions for `docker import -c`
recipe_extra_inputs() { :; }
IMPORT_CHANGES=()
# shellcheck source=/dev/null
source "$RECIPE_DIR/recipe.sh"

command -v docker >/dev/null 2>&1 || die "docker CLI not found (run scripts/ensure-docker.sh)"
docker info >/dev/null 2>&1 || die "docker daemon not reachable (run scripts/ensure-docker.sh)"

# --- content hash -------------------------------------------------------------
compute_hash() {
    (
        cd "$HERE"
        printf 'sandboxd-image-v1 %s\n' "$NAME"
        {
            echo build.sh
            find lib "$NAME" -type f
        } | LC_ALL=C sort | while IFS= read -r f; do
            printf '%s %s\n' "$(sha256sum <"$f" | cut -d' ' -f1)" "$f"
        done
        recipe_extra_inputs
    ) | sha256sum | cut -c1-12
}

HASH="$(compute_hash)"
REF="sandboxd/$NAME:$HASH"
LATEST="sandboxd/$NAME:latest"

if [ "${SANDBOXD_IMAGE_FORCE:-0}" != 1 ] && docker image inspect "$REF" >/dev/null 2>&1; then
    docker tag "$REF" "$LATEST"
    log "cached: $REF"
    echo "$REF"
    exit 0
fi

# --- build --------------------------------------------------------------------
TMPBASE="${SANDBOXD_IMAGE_TMPDIR:-/var/tmp}"
WORK="$(mktemp -d "$TMPBASE/sandboxd-image-$NAME.XXXXXX")"
ROOTFS="$WORK/rootfs"
mkdir -p "$ROOTFS"

cleanup() {
    local rc=$?
    # Never rm -rf through a mount (debootstrap mounts proc/sys/devpts in the
    # target and may leave them behind on failure): unmount, deepest first.
    local m
    while read -r m; do
        umount -l "$m" 2>/dev/null || true
    done < <(awk -v w="$WORK" 'index($2, w "/") == 1 { print $2 }' /proc/self/mounts | sort -r)
    if awk -v w="$WORK" 'index($2, w "/") == 1 { found = 1 } END { exit !found }' /proc/self/mounts; then
        log "WARNING: mounts remain under $WORK; not removing it"
    else
        rm -rf --one-file-system "$WORK"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Fixed timestamp for reproducibility (honoured by tar below and by tools in
# the recipe that support it).
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-1700000000}"

start=$(date +%s)
log "building $REF in $WORK"
recipe_build "$ROOTFS"

# Mount points the sandbox relies on (root fs is read-only at run time).
install -d -m 0755 -o 0 -g 0 "$ROOTFS/workspace"
install -d -m 1777 -o 0 -g 0 "$ROOTFS/tmp"
chmod 1777 "$ROOTFS/tmp"

# Deterministic tarball: sorted names, numeric ids, clamped mtimes.
tar --create --file "$WORK/rootfs.tar" --directory "$ROOTFS" \
    --sort=name --numeric-owner --one-file-system \
    --mtime="@$SOURCE_DATE_EPOCH" --clamp-mtime \
    --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
    .

import_args=()
for c in "${IMPORT_CHANGES[@]}"; do
    import_args+=(--change "$c")
done
import_args+=(--change "LABEL org.sandboxd.image=$NAME org.sandboxd.recipe-hash=$HASH")

prev_id=$(docker image inspect --format '{{.Id}}' "$REF" 2>/dev/null || true)  # forced rebuild
docker import "${import_args[@]}" --message "sandboxd $NAME image (recipe $HASH)" \
    "$WORK/rootfs.tar" "$REF" >/dev/null
docker tag "$REF" "$LATEST"

# Drop images of older recipes of this NAME (never forced: an image still used
# by a container is kept).  SANDBOXD_IMAGE_KEEP_OLD=1 keeps them all.
if [ "${SANDBOXD_IMAGE_KEEP_OLD:-0}" != 1 ]; then
    new_id=$(docker image inspect --format '{{.Id}}' "$REF")
    docker image ls --format '{{.Repository}}:{{.Tag}} {{.ID}}' "sandboxd/$NAME" |
        while read -r ref id; do
            case "$ref" in *:latest | "$REF" | *:"<none>") continue ;; esac
            [[ "$new_id" == *"$id"* ]] && continue
            if docker image rm "$ref" >/dev/null 2>&1; then
                log "removed old image $ref"
            fi
        done
fi

if [ -n "$prev_id" ] && [ "$prev_id" != "$(docker image inspect --format '{{.Id}}' "$REF")" ]; then
    docker image rm "$prev_id" >/dev/null 2>&1 || true
fi

size=$(docker image inspect --format '{{.Size}}' "$REF")
log "built $REF in $(($(date +%s) - start))s, $((size / 1024 / 1024)) MiB"
echo "$REF"
