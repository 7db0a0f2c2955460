"""The Docker backend's seccomp profile (seccomp/sandboxd-docker.json) compiled into a
classic BPF program with libseccomp, the way runc does it, so that an nsjail jail is
held to exactly the same profile: the shim loads the program (`--seccomp`) before it
execs the jail's init. kafel (nsjail's own policy language) kills any call of another
architecture's ABI (`int 0x80` from a 64-bit process) before its rules run; this
program, like Docker's, answers i386 and x32 calls with the profile's errno."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import platform
from typing import Any

# libseccomp's values (seccomp.h).
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_ACT_KILL_THREAD = 0x00000000  # runc's SCMP_ACT_KILL
SCMP_ACT_KILL_PROCESS = 0x80000000
EPERM = 1
_ARCHES = {  # SCMP_ARCH_* (AUDIT_ARCH_* values)
    "SCMP_ARCH_X86_64": 0xC000003E,
    "SCMP_ARCH_X86": 0x40000003,
    "SCMP_ARCH_X32": 0x4000003E,
    "SCMP_ARCH_AARCH64": 0xC00000B7,
    "SCMP_ARCH_ARM": 0x40000028,
}
# Docker's `includes.arches` names for each native architecture (runc's arch map).
_NATIVE = {"x86_64": ("SCMP_ARCH_X86_64", {"amd64", "x86_64"}), "aarch64": ("SCMP_ARCH_AARCH64", {"arm64"})}
_OPS = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4, "SCMP_CMP_GE": 5, "SCMP_CMP_GT": 6,
        "SCMP_CMP_MASKED_EQ": 7}
_NR_SCMP_ERROR = -1


class ProfileError(Exception):
    pass


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _errno_action(value: int) -> int:
    return 0x00050000 | (value & 0xFFFF)


def _libseccomp() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise ProfileError(f"libseccomp is missing ({exc}); install Debian's libseccomp2") from None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def _action(name: str, errno_ret: int | None) -> int:
    """runc's reading: an errno action without its own errnoRet is EPERM (the profile's
    defaultErrnoRet is for the default action only)."""
    if name == "SCMP_ACT_ALLOW":
        return SCMP_ACT_ALLOW
    if name == "SCMP_ACT_ERRNO":
        return _errno_action(EPERM if errno_ret is None else errno_ret)
    if name == "SCMP_ACT_KILL":
        return SCMP_ACT_KILL_THREAD
    if name == "SCMP_ACT_KILL_PROCESS":
        return SCMP_ACT_KILL_PROCESS
    raise ProfileError(f"unsupported seccomp action {name!r}")


def _default_action(profile: dict[str, Any]) -> int:
    if profile.get("defaultAction") == "SCMP_ACT_ERRNO":
        return _errno_action(int(profile.get("defaultErrnoRet") or EPERM))
    return _action(str(profile.get("defaultAction")), None)


def rules_for(profile: dict[str, Any], machine: str, caps: frozenset[str] = frozenset()
              ) -> list[tuple[int, str, list[Any]]]:
    """(action, syscall name, conditions) for each rule libseccomp is given, as runc
    reads a Docker profile: rules for other architectures or for capabilities the
    sandbox lacks left out, and several conditions on one argument meaning "any of"
    (a rule each), otherwise "all of" (one rule). Pure."""
    if machine not in _NATIVE:
        raise ProfileError(f"no seccomp architecture map for {machine}")
    _, native_names = _NATIVE[machine]
    default = _default_action(profile)
    out: list[tuple[int, str, list[Any]]] = []
    for rule in profile.get("syscalls") or []:
        inc, exc = rule.get("includes") or {}, rule.get("excludes") or {}
        if inc.get("arches") and not native_names & set(inc["arches"]):
            continue
        if exc.get("arches") and native_names & set(exc["arches"]):
            continue
        if inc.get("caps") and not set(inc["caps"]) <= caps:
            continue
        if exc.get("caps") and set(exc["caps"]) & caps:
            continue
        if inc.get("minKernel") or exc.get("minKernel"):
            raise ProfileError("minKernel in a seccomp rule is not supported")
        action = _action(rule["action"], rule.get("errnoRet"))
        if action == default:
            continue  # what the default does anyway (libseccomp refuses such a rule; runc skips it)
        try:
            args = [(int(a["index"]), _OPS[a["op"]], int(a["value"]), int(a.get("valueTwo", 0)))
                    for a in rule.get("args") or []]
        except KeyError as exc:
            raise ProfileError(f"unsupported seccomp argument condition: {exc}") from None
        indexes = [a[0] for a in args]
        groups = [[a] for a in args] if len(set(indexes)) < len(indexes) else [args]
        names = rule.get("names") or ([rule["name"]] if rule.get("name") else [])  # "name": the old format
        for name in names:
            for conditions in groups:
                out.append((action, name, conditions))
    return out


def compile_profile(profile_text: str, machine: str | None = None) -> bytes:
    """The BPF program (struct sock_filter[]) for the profile on this machine.
    ProfileError for anything it cannot read the way runc would."""
    try:
        return _compile(json.loads(profile_text), machine or platform.machine())
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProfileError(f"malformed seccomp profile: {type(exc).__name__}: {exc}") from None


def _compile(profile: dict[str, Any], machine: str) -> bytes:
    native, _ = _NATIVE.get(machine, (None, None))
    if native is None:
        raise ProfileError(f"no seccomp architecture map for {machine}")
    default = _default_action(profile)
    rules = rules_for(profile, machine)
    lib = _libseccomp()
    ctx = lib.seccomp_init(default)
    if not ctx:
        raise ProfileError("seccomp_init failed")
    try:
        arches = [sub for entry in profile.get("archMap") or [] if entry["architecture"] == native
                  for sub in entry.get("subArchitectures") or []]
        arches += profile.get("architectures") or []  # the old format's flat list
        for arch in arches:
            if arch in _ARCHES and arch != native:
                rc = lib.seccomp_arch_add(ctx, _ARCHES[arch])
                if rc not in (0, -17):  # -EEXIST: already there
                    raise ProfileError(f"seccomp_arch_add {arch}: {os.strerror(-rc)}")
        for action, name, conditions in rules:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr == _NR_SCMP_ERROR:
                continue  # unknown to this libseccomp (runc skips these too)
            array = (_ArgCmp * max(1, len(conditions)))(*[_ArgCmp(*c) for c in conditions])
            rc = lib.seccomp_rule_add_array(ctx, action, nr, len(conditions), array)
            if rc < 0 and not (nr < 0 and rc in (-22, -14)):  # a pseudo-syscall absent from an arch
                raise ProfileError(f"seccomp rule for {name}: {os.strerror(-rc)}")
        fd = os.memfd_create("seccomp-bpf", os.MFD_CLOEXEC)  # a pipe could fill and block the export
        try:
            rc = lib.seccomp_export_bpf(ctx, fd)
            if rc < 0:
                raise ProfileError(f"seccomp_export_bpf: {os.strerror(-rc)}")
            os.lseek(fd, 0, os.SEEK_SET)
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
        finally:
            os.close(fd)
        program = b"".join(chunks)
        if not program or len(program) % 8:
            raise ProfileError("libseccomp exported an empty or malformed program")
        return program
    finally:
        lib.seccomp_release(ctx)
