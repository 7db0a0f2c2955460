#!/usr/bin/env python3
"""Builds the cgroup2 test guest's initramfs (a gzipped newc cpio) from an extracted
Debian kernel package, a static busybox and init.sh.

Usage: mkinitramfs.py KERNEL_TREE BUSYBOX INIT OUT MODULE...

KERNEL_TREE is the `dpkg-deb -x` of a linux-image package (it has lib/modules/<ver>/).
Each MODULE is resolved with its dependencies (read from the modules' own `depends=`
modinfo field, since the package ships no modules.dep); modules that are built into
the kernel (modules.builtin) are skipped. The modules land flat in /modules of the
archive, with /modules/load listing them in load order for init.sh.
"""
import gzip
import io
import os
import sys


def modinfo_depends(path):
    with open(path, "rb") as f:
        data = f.read()
    i = data.find(b"\0depends=")
    if i < 0:
        return []
    end = data.index(b"\0", i + 1)
    value = data[i + len(b"\0depends="):end].decode()
    return [d for d in value.split(",") if d]


def resolve(moddir, wanted):
    by_name = {}
    for dirpath, _, files in os.walk(os.path.join(moddir, "kernel")):
        for name in files:
            if name.endswith(".ko"):
                by_name[name[:-3].replace("-", "_")] = os.path.join(dirpath, name)
    builtin = set()
    with open(os.path.join(moddir, "modules.builtin")) as f:
        for line in f:
            builtin.add(os.path.basename(line.strip())[:-3].replace("-", "_"))
    order, seen = [], set()

    def visit(name, chain):
        name = name.replace("-", "_")
        if name in seen:
            return
        if name in builtin:
            seen.add(name)
            return
        if name not in by_name:
            sys.exit(f"mkinitramfs: module {name} (wanted by {' <- '.join(chain) or 'caller'}) not found")
        if name in chain:
            sys.exit(f"mkinitramfs: dependency loop at {name}")
        for dep in modinfo_depends(by_name[name]):
            visit(dep, chain + [name])
        seen.add(name)
        order.append(name)

    for w in wanted:
        visit(w, [])
    return [(n, by_name[n]) for n in order]


class Cpio:
    def __init__(self):
        self.buf = io.BytesIO()
        self.ino = 1

    def _entry(self, name, mode, data=b"", rdev=(0, 0), nlink=1):
        name_b = name.encode() + b"\0"
        hdr = "070701" + "".join(f"{v:08x}" for v in (
            self.ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rdev[0], rdev[1], len(name_b), 0))
        self.ino += 1
        self.buf.write(hdr.encode() + name_b)
        self.buf.write(b"\0" * (-(110 + len(name_b)) % 4))
        self.buf.write(data)
        self.buf.write(b"\0" * (-len(data) % 4))

    def dir(self, name):
        self._entry(name, 0o040755, nlink=2)

    def file(self, name, data, perm=0o644):
        self._entry(name, 0o100000 | perm, data)

    def symlink(self, name, target):
        self._entry(name, 0o120777, target.encode())

    def chardev(self, name, major, minor, perm=0o600):
        self._entry(name, 0o020000 | perm, rdev=(major, minor))

    def finish(self):
        self._entry("TRAILER!!!", 0)
        return self.buf.getvalue()


def main():
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    tree, busybox, init, out, *wanted = sys.argv[1:]
    versions = os.listdir(os.path.join(tree, "lib", "modules"))
    if len(versions) != 1:
        sys.exit(f"mkinitramfs: expected one kernel version under {tree}/lib/modules, got {versions}")
    moddir = os.path.join(tree, "lib", "modules", versions[0])
    mods = resolve(moddir, wanted)

    c = Cpio()
    for d in ("bin", "dev", "proc", "sys", "newroot", "exchange", "modules", "tmp"):
        c.dir(d)
    c.chardev("dev/console", 5, 1)
    c.chardev("dev/null", 1, 3, 0o666)
    with open(busybox, "rb") as f:
        c.file("bin/busybox", f.read(), 0o755)
    c.symlink("bin/sh", "busybox")
    with open(init, "rb") as f:
        c.file("init", f.read(), 0o755)
    for name, path in mods:
        with open(path, "rb") as f:
            c.file(f"modules/{name}.ko", f.read())
    c.file("modules/load", "".join(f"{n}\n" for n, _ in mods).encode())
    c.file("kernel-version", (versions[0] + "\n").encode())

    tmp = out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(gzip.compress(c.finish(), compresslevel=6, mtime=0))
    os.replace(tmp, out)
    print(f"mkinitramfs: {out}: modules {' '.join(n for n, _ in mods)}", file=sys.stderr)


if __name__ == "__main__":
    main()
