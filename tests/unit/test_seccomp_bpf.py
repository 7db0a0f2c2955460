"""sandboxd.backends.nsjail.seccomp_bpf: the Docker profile read as runc reads it (pure), compiled by
libseccomp, and loaded by the shim on this host: what the profile allows works, what
it denies fails with its errno, 32-bit calls included, and nothing is killed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sandboxd.core.assets import SECCOMP_PROFILE, packaged
from sandboxd.core.assets import SHIM as SHIM_ASSET

import pytest

from sandboxd.backends.nsjail import seccomp_bpf

from ..probes import PROBE, assert_denied_without_kill

PROFILE = packaged(SECCOMP_PROFILE).read_text()
SHIM = packaged(SHIM_ASSET)


def names(rules):
    return {name for _, name, _ in rules}


def test_rules_keep_the_native_arches_and_drop_other_arches_and_capabilities():
    rules = seccomp_bpf.rules_for(json.loads(PROFILE), "x86_64")
    got = names(rules)
    assert {"read", "execve", "arch_prctl", "modify_ldt", "clone", "socket"} <= got
    # Other architectures' calls, capability-only calls (the sandbox has none), and
    # what the profile leaves out altogether.
    assert not got & {"s390_runtime_instr", "riscv_flush_icache", "sync_file_range2", "chroot", "mbind",
                      "ptrace", "io_uring_setup", "bpf", "mount", "unshare"}


def test_conditions_on_one_argument_are_alternatives_and_on_several_all_of_them():
    profile = {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [
        {"names": ["personality"], "action": "SCMP_ACT_ALLOW", "args": [
            {"index": 0, "value": 0, "op": "SCMP_CMP_EQ"}, {"index": 0, "value": 8, "op": "SCMP_CMP_EQ"}]},
        {"names": ["socket"], "action": "SCMP_ACT_ALLOW", "args": [
            {"index": 0, "value": 2, "op": "SCMP_CMP_EQ"}, {"index": 1, "value": 1, "valueTwo": 15,
                                                            "op": "SCMP_CMP_MASKED_EQ"}]},
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38},
    ]}
    rules = seccomp_bpf.rules_for(profile, "x86_64")
    allow, enosys = seccomp_bpf.SCMP_ACT_ALLOW, 0x00050000 | 38
    assert rules == [(allow, "personality", [(0, 4, 0, 0)]), (allow, "personality", [(0, 4, 8, 0)]),
                     (allow, "socket", [(0, 4, 2, 0), (1, 7, 1, 15)]), (enosys, "clone3", [])]


def test_unsupported_profiles_are_refused():
    with pytest.raises(seccomp_bpf.ProfileError, match="action"):
        seccomp_bpf.rules_for({"syscalls": [{"names": ["read"], "action": "SCMP_ACT_TRACE"}]}, "x86_64")
    with pytest.raises(seccomp_bpf.ProfileError, match="architecture"):
        seccomp_bpf.compile_profile(PROFILE, machine="sparc64")


def test_the_compiled_profile_allows_and_denies_on_this_host_without_killing(tmp_path):
    program = seccomp_bpf.compile_profile(PROFILE)
    assert len(program) % 8 == 0 and 200 < len(program) // 8 < 4096
    path = tmp_path / "profile.bpf"
    path.write_bytes(program)
    out = subprocess.run([str(SHIM), "--seccomp", str(path), "--", sys.executable, "-"], input=PROBE,
                         capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr
    probes = json.loads(out.stdout)
    assert_denied_without_kill(probes)
    assert probes["i386_socket_af_vsock"]["errname"] == "EPERM"
    assert probes["i386_socketcall_af_vsock"]["errname"] == "ENOSYS"


def test_a_program_the_shim_cannot_load_stops_it_before_the_command(tmp_path):
    bad = tmp_path / "bad.bpf"
    bad.write_bytes(b"\x06\x00\x00\x00")  # not a whole instruction
    out = subprocess.run([str(SHIM), "--seccomp", str(bad), "--", "/bin/echo", "ran"], capture_output=True, timeout=10)
    assert out.returncode == 126 and out.stdout == b"" and b"seccomp program" in out.stderr
    out = subprocess.run([str(SHIM), "--seccomp", str(tmp_path / "missing"), "--", "/bin/echo", "ran"],
                         capture_output=True, timeout=10)
    assert out.returncode == 126 and out.stdout == b""


def test_profiles_runc_accepts_compile_as_runc_reads_them():
    base = json.loads(PROFILE)
    # A rule that repeats the default action (libseccomp refuses it; runc skips it), an
    # errno rule without errnoRet (EPERM, not defaultErrnoRet), the old "name" key.
    base["defaultErrnoRet"] = 13
    base["syscalls"] += [{"names": ["swapon"], "action": "SCMP_ACT_ERRNO", "errnoRet": 13},
                         {"names": ["acct"], "action": "SCMP_ACT_ERRNO"},
                         {"name": "vhangup", "action": "SCMP_ACT_KILL"}]
    rules = seccomp_bpf.rules_for(base, "x86_64")
    assert "swapon" not in names(rules)
    assert (0x00050000 | 1, "acct", []) in rules
    assert (seccomp_bpf.SCMP_ACT_KILL_THREAD, "vhangup", []) in rules
    assert len(seccomp_bpf.compile_profile(json.dumps(base))) > 0


@pytest.mark.parametrize("broken", [
    {"syscalls": []},  # no defaultAction
    {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": "read"},
    {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ALLOW",
                                                      "args": [{"index": 0, "value": 1, "op": "SCMP_CMP_WHAT"}]}]},
    {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [{"action": "SCMP_ACT_ALLOW"}], "archMap": "x"},
])
def test_a_malformed_profile_is_a_profile_error_never_a_crash(broken):
    with pytest.raises(seccomp_bpf.ProfileError):
        seccomp_bpf.compile_profile(json.dumps(broken))
    with pytest.raises(seccomp_bpf.ProfileError):
        seccomp_bpf.compile_profile("{not json")
