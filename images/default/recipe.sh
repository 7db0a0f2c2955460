# shellcheck shell=bash
# Recipe for sandboxd/default: Debian bookworm minbase + python3, git, ...
# Sourced by images/build.sh (see the recipe API there).

SUITE=bookworm
FALLBACK_MIRROR=http://deb.debian.org/debian
# Mirror written into the image's own apt sources (not the build mirror).
IMAGE_APT_MIRROR=http://deb.debian.org/debian

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

recipe_build() {
    local rootfs="$1" mirror include
    command -v debootstrap >/dev/null 2>&1 \
        || die "debootstrap not installed (run scripts/ensure-docker.sh)"
    mirror="$(detect_mirror)"
    include="$(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$RECIPE_DIR/packages" | tr -d ' \t' | paste -sd, -)"
    log "debootstrap --variant=minbase $SUITE from $mirror (+ $include)"

    # Keep downloaded .debs between builds (speeds up rebuilds after a recipe
    # change; harmless when absent).
    local cache=/var/cache/sandboxd/debootstrap
    mkdir -p "$cache"

    debootstrap --variant=minbase --components=main --merged-usr \
        --include="$include" --cache-dir="$cache" \
        "$SUITE" "$rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 || {
        tail -n 30 "$WORK/debootstrap.log" >&2
        [ -f "$rootfs/debootstrap/debootstrap.log" ] && tail -n 30 "$rootfs/debootstrap/debootstrap.log" >&2
        die "debootstrap failed"
    }

    # Image-side apt sources point at the canonical mirror, whatever we built from.
    rm -f "$rootfs/etc/apt/sources.list"
    cat >"$rootfs/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $IMAGE_APT_MIRROR
Suites: $SUITE ${SUITE}-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF

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
