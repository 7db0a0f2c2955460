# shellcheck shell=bash
# Recipe for sandboxd/busybox: a single static busybox (Debian busybox-static)
# plus applet symlinks.  No package manager, no python.
# Sourced by images/build.sh (see the recipe API there).

BUSYBOX_BIN="${BUSYBOX_BIN:-/bin/busybox}"

# shellcheck disable=SC2034  # read by images/build.sh
IMPORT_CHANGES=(
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    "WORKDIR /workspace"
    'CMD ["/bin/sh"]'
)

check_busybox() {
    [ -x "$BUSYBOX_BIN" ] || die "$BUSYBOX_BIN missing (apt-get install busybox-static, or run scripts/ensure-docker.sh)"
    # Must be static: the image has no libc.
    if LC_ALL=C ldd "$BUSYBOX_BIN" >/dev/null 2>&1; then
        die "$BUSYBOX_BIN is dynamically linked; install busybox-static"
    fi
}

# The binary is part of the image content, so it is part of the cache key.
recipe_extra_inputs() {
    check_busybox
    printf '%s busybox-binary\n' "$(sha256sum <"$BUSYBOX_BIN" | cut -d' ' -f1)"
}

recipe_build() {
    local rootfs="$1" applet
    check_busybox
    install -d -m 0755 "$rootfs"/{bin,sbin,usr/bin,usr/sbin,etc,root,var,proc,sys,dev,workspace}
    install -d -m 1777 "$rootfs/tmp" "$rootfs/var/tmp"
    install -m 0755 "$BUSYBOX_BIN" "$rootfs/bin/busybox"
    # Applet symlinks at the paths busybox itself reports (bin/ls, usr/bin/awk, ...).
    while IFS= read -r applet; do
        case "$applet" in
            "" | bin/busybox | linuxrc) continue ;;
        esac
        install -d -m 0755 "$rootfs/$(dirname "$applet")"
        [ -e "$rootfs/$applet" ] || ln -s /bin/busybox "$rootfs/$applet"
    done < <("$BUSYBOX_BIN" --list-full)
    [ -e "$rootfs/bin/sh" ] || ln -s /bin/busybox "$rootfs/bin/sh"

    cat >"$rootfs/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
sandbox:x:1000:1000:sandbox:/workspace:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
EOF
    cat >"$rootfs/etc/group" <<'EOF'
root:x:0:
sandbox:x:1000:
nogroup:x:65534:
EOF
    chmod 0644 "$rootfs/etc/passwd" "$rootfs/etc/group"
    chmod 0700 "$rootfs/root"
    echo sandbox >"$rootfs/etc/hostname"
    : >"$rootfs/etc/hosts"
    : >"$rootfs/etc/resolv.conf"
}
