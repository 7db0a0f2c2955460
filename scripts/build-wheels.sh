#!/usr/bin/env bash
# Builds the three wheels into OUT_DIR: sandboxd-contract (contract/), sandboxd-client
# (client/) and sandboxd (daemon/, with the native helpers; `make native` first if any
# is missing). docs/INSTALL.md says how to install them.
#
#   scripts/build-wheels.sh OUT_DIR [--no-isolation]
#
# --no-isolation builds with the dev venv's setuptools instead of a fresh one per wheel
# (no index needed; the default is the ordinary isolated build).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
python="${PYTHON:-$root/.venv/bin/python}"
# The version of `build` this script was written against; installed into the dev venv
# when missing (the root pyproject.toml stays the development install's).
build_requirement="build==1.6.1"

usage() { echo "usage: $0 OUT_DIR [--no-isolation]" >&2; exit 2; }
[ $# -ge 1 ] && [ -n "$1" ] || usage
out=$1
shift
isolation=()
for arg in "$@"; do
  case "$arg" in
    --no-isolation) isolation=(--no-isolation) ;;
    *) usage ;;
  esac
done
[ -x "$python" ] || { echo "$python is missing: run 'make venv' first (or set PYTHON)" >&2; exit 1; }
mkdir -p "$out"
out=$(cd "$out" && pwd)

assets=daemon/sandboxd/assets
for helper in sandbox-shim libsandboxd-fanotify.so libsandboxd-relay.so sandboxd-cgroup-exec; do
  if [ ! -f "$assets/$helper" ]; then
    make native
    break
  fi
done

if ! "$python" -m build --version >/dev/null 2>&1; then
  "$python" -m pip install -q --disable-pip-version-check "$build_requirement"
fi

# Each project is built from a copy: setuptools leaves build/ and *.egg-info beside its
# sources, and a build/ kept from an earlier run would carry modules deleted since.
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
for project in contract client daemon; do
  mkdir "$stage/$project"
  tar -C "$project" --exclude=__pycache__ --exclude='*.pyc' --exclude=./build --exclude='*.egg-info' -cf - . \
    | tar -C "$stage/$project" -xf -
  "$python" -m build --wheel "${isolation[@]}" --outdir "$stage/wheels" "$stage/$project" >"$stage/$project.log" 2>&1 \
    || { cat "$stage/$project.log" >&2; echo "building the $project wheel failed" >&2; exit 1; }
done

# The three are released together: the daemon needs the contract of its own version,
# the client a range holding it; the daemon's wheel is platform-tagged and carries every
# helper. A wheel that breaks any of these is not handed out.
"$python" - "$stage/wheels" <<'PY'
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import parse_wheel_filename

wheels = {parse_wheel_filename(p.name)[0]: p for p in Path(sys.argv[1]).glob("*.whl")}
assert set(wheels) == {"sandboxd", "sandboxd-client", "sandboxd-contract"}, sorted(wheels)


def metadata(name):
    with zipfile.ZipFile(wheels[name]) as z:
        [path] = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(z.read(path).decode())


def contract_requirement(name):
    [req] = [r for r in map(Requirement, metadata(name).get_all("Requires-Dist")) if r.name == "sandboxd-contract"]
    return req


contract = parse_wheel_filename(wheels["sandboxd-contract"].name)[1]
daemon = parse_wheel_filename(wheels["sandboxd"].name)[1]
problems = []
if daemon != contract:
    problems.append(f"sandboxd {daemon} and sandboxd-contract {contract} differ")
if str(contract_requirement("sandboxd").specifier) != f"=={contract}":
    problems.append(f"sandboxd requires {contract_requirement('sandboxd')}, not sandboxd-contract=={contract}")
if not contract_requirement("sandboxd-client").specifier.contains(contract):
    problems.append(f"sandboxd-client requires {contract_requirement('sandboxd-client')}, not {contract}")
for name in ("sandboxd-client", "sandboxd-contract"):
    if any("==" in str(Requirement(r).specifier) for r in metadata(name).get_all("Requires-Dist")):
        problems.append(f"{name} pins a dependency with ==: libraries take ranges")
tags = parse_wheel_filename(wheels["sandboxd"].name)[3]
if any(tag.platform == "any" for tag in tags):
    problems.append(f"{wheels['sandboxd'].name} is not platform-tagged, yet carries native helpers")
with zipfile.ZipFile(wheels["sandboxd"]) as z:
    names = set(z.namelist())
for helper in ("sandbox-shim", "libsandboxd-fanotify.so", "libsandboxd-relay.so", "sandboxd-cgroup-exec",
               "seccomp/sandboxd-docker.json"):
    if f"sandboxd/assets/{helper}" not in names:
        problems.append(f"{wheels['sandboxd'].name} lacks sandboxd/assets/{helper}")
if problems:
    sys.exit("refusing the wheels:\n  " + "\n  ".join(problems))
PY

for wheel in "$stage"/wheels/*.whl; do
  cp "$wheel" "$out/"
  echo "$out/$(basename "$wheel")"
done
