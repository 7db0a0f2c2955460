# shellcheck shell=bash
# Shared by the Debian-based recipes (images/default, images/minimal): a bookworm
# `debootstrap --variant=minbase` with the packages listed in images/NAME/packages,
# then apt-get (in the new root) for those in images/NAME/apt-packages, if any, then
# the sandbox account and the trims.  Two steps because debootstrap's own resolver
# takes the first alternative of a dependency and knows no virtual packages (npm's
# node-* dependencies need both); apt does, and installs no recommendations here.  Sourced by a recipe, which build.sh sources;
# this file is part of every image's content hash (build.sh hashes lib/).

SUITE=bookworm
FALLBACK_MIRROR=http://deb.debian.org/debian
# Mirror written into the image's own apt sources (not the build mirror).
IMAGE_APT_MIRROR=http://deb.debian.org/debian
# Downloaded .debs are kept here between builds (SANDBOXD_IMAGE_DEB_CACHE overrides).
DEB_CACHE="${SANDBOXD_IMAGE_DEB_CACHE:-/var/cache/sandboxd/debootstrap}"

# shellcheck disable=SC2034  # read by images/build.sh
IMPORT_CHANGES=(
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    "ENV LANG=C.UTF-8"
    "WORKDIR /workspace"
    'CMD ["/bin/sh"]'
)

# Pick the Debian mirror from the host's apt configuration: first deb822
# stanza (/etc/apt/sources.list.d/*.sources) or one-line entry
# (/etc/apt/sources.list*) that serves $SUITE with component main.
detect_mirror() {
    local uri=""
    if [ -n "${DEBIAN_MIRROR:-}" ]; then
        echo "$DEBIAN_MIRROR"
        return
    fi
    shopt -s nullglob
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        uri=$(awk -v suite="$SUITE" '
            function flush() {
                if (types ~ /(^| )deb( |$)/ && (" " suites " ") ~ (" " suite " ") &&
                    (" " comps " ") ~ / main / && uris != "" && enabled != "no") {
                    split(uris, u, " "); print u[1]; found = 1; exit
                }
                types = suites = comps = uris = ""; enabled = ""
            }
            /^[ \t]*#/ { next }
            /^[ \t]*$/ { flush(); next }
            {
                key = tolower($1); sub(/:$/, "", key)
                val = $0; sub(/^[^:]*:[ \t]*/, "", val)
                if (key == "types") types = val
                else if (key == "suites") suites = val
                else if (key == "components") comps = val
                else if (key == "uris") uris = val
                else if (key == "enabled") enabled = tolower(val)
            }
            END { if (!found) flush() }
        ' "$f")
        [ -n "$uri" ] && break
    done
    if [ -z "$uri" ]; then
        for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
            [ -f "$f" ] || continue
            uri=$(awk -v suite="$SUITE" '
                $1 == "deb" {
                    i = 2
                    if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                    if ($(i + 1) == suite) { print $i; exit }
                }' "$f")
            [ -n "$uri" ] && break
        done
    fi
    shopt -u nullglob
    echo "${uri:-$FALLBACK_MIRROR}"
}

# A package list of this recipe (images/NAME/FILE) without comments and blanks.
recipe_packages() {
    [ -f "$RECIPE_DIR/$1" ] || return 0
    sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$RECIPE_DIR/$1" | tr -d ' \t'
}

# apt-get install, inside ROOTFS, of the packages in images/NAME/apt-packages (from
# the mirror debootstrap wrote into its sources.list), keeping the .debs in
# $DEB_CACHE/apt.  /proc and the cache are mounted for it and unmounted after (and
# build.sh's cleanup unmounts whatever an interrupted build left).
apt_install() {
    local rootfs="$1" packages archives="$DEB_CACHE/apt"
    packages="$(recipe_packages apt-packages | paste -sd' ' -)"
    [ -n "$packages" ] || return 0
    log "apt-get install --no-install-recommends $packages"
    mkdir -p "$archives/partial"
    cp -L /etc/resolv.conf "$rootfs/etc/resolv.conf"
    # No service may start inside the build root.
    printf '#!/bin/sh\nexit 101\n' >"$rootfs/usr/sbin/policy-rc.d"
    chmod 0755 "$rootfs/usr/sbin/policy-rc.d"
    mount -t proc proc "$rootfs/proc"
    mount --bind "$archives" "$rootfs/var/cache/apt/archives"
    local rc=0
    {
        in_root "$rootfs" apt-get update &&
            # shellcheck disable=SC2086  # one word per package
            in_root "$rootfs" apt-get install -y --no-install-recommends $packages
    } >>"$WORK/apt.log" 2>&1 || rc=$?
    umount "$rootfs/var/cache/apt/archives"
    umount "$rootfs/proc"
    rm -f "$rootfs/usr/sbin/policy-rc.d"
    if [ "$rc" != 0 ]; then
        tail -n 30 "$WORK/apt.log" >&2
        die "apt-get failed in the build root"
    fi
}

in_root() {
    local rootfs="$1"
    shift
    chroot "$rootfs" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C.UTF-8 \
        DEBIAN_FRONTEND=noninteractive "$@" -q -o Dpkg::Use-Pty=0 -o APT::Sandbox::User=root
}

debian_build() {
    local rootfs="$1" mirror include
    command -v debootstrap >/dev/null 2>&1 \
        || die "debootstrap not installed (run scripts/ensure-docker.sh)"
    mirror="$(detect_mirror)"
    include="$(recipe_packages packages | paste -sd, -)"
    log "debootstrap --variant=minbase $SUITE from $mirror (+ $include)"

    mkdir -p "$DEB_CACHE"
    debootstrap --variant=minbase --components=main --merged-usr \
        --include="$include" --cache-dir="$DEB_CACHE" \
        "$SUITE" "$rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 || {
        tail -n 30 "$WORK/debootstrap.log" >&2
        [ -f "$rootfs/debootstrap/debootstrap.log" ] && tail -n 30 "$rootfs/debootstrap/debootstrap.log" >&2
        die "debootstrap failed"
    }
    apt_install "$rootfs"

    # Image-side apt sources point at the canonical mirror, whatever we built from.
    rm -f "$rootfs/etc/apt/sources.list"
    cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<SOURCES
Types: deb
URIs: $IMAGE_APT_MIRROR
Suites: $SUITE ${SUITE}-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES

    # Unprivileged account the daemon can run tool calls as (uid/gid 1000).
    echo 'sandbox:x:1000:1000:sandbox:/workspace:/bin/bash' >>"$rootfs/etc/passwd"
    echo 'sandbox:x:1000:' >>"$rootfs/etc/group"
    echo 'sandbox:!:19000:0:99999:7:::' >>"$rootfs/etc/shadow"
    echo 'sandbox:!::' >>"$rootfs/etc/gshadow"

    # Trim: package caches/lists, logs, docs (copyright files kept), man pages,
    # translations, and per-build noise that breaks reproducibility.
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* \
        "$rootfs"/var/cache/debconf/*-old "$rootfs"/var/lib/dpkg/*-old \
        "$rootfs"/var/cache/ldconfig/aux-cache \
        "$rootfs"/usr/share/man "$rootfs"/usr/share/info \
        "$rootfs"/usr/share/lintian "$rootfs"/usr/share/linda \
        "$rootfs"/debootstrap
    find "$rootfs/var/log" -type f -delete
    find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +
    find "$rootfs/usr/share/doc" ! -type d ! -name copyright -delete
    find "$rootfs/usr/share/doc" -depth -type d -empty -delete
    : >"$rootfs/etc/machine-id"
    rm -f "$rootfs/var/lib/dbus/machine-id"
    echo sandbox >"$rootfs/etc/hostname"
    : >"$rootfs/etc/resolv.conf"
}
