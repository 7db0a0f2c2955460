"""sandboxd.policy.models: parsing, defaults, normalization, refusals and admission."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from google.protobuf import json_format

from sandboxd.core.errors import InvalidArgument, PermissionDenied, SandboxdError
from sandboxd.policy.admission import check_admission, check_private_networks
from sandboxd.policy.models import (
    BASE_ENV_NAMES,
    BASE_PATH,
    MAX_ARG_CHARS,
    MAX_ENV_VALUE_CHARS,
    MAX_FIELD_CHARS,
    EffectivePolicy,
    is_within,
    normalize_sandbox_path,
    parse_call,
    parse_policy,
    resolve_policy,
)
from sandboxd.core.settings import LimitSettings
from sandboxd_contract.calls import build_call

from .conftest import LIMITS, call_dict, resolve

MB = 2**20


def refused(cls, fn, *args, **kwargs) -> SandboxdError:
    with pytest.raises(SandboxdError) as info:
        fn(*args, **kwargs)
    exc = info.value
    assert type(exc) is cls, f"expected {cls.__name__}, got {type(exc).__name__}: {exc}"
    return exc


# ------------------------------------------------------------------ defaults


def test_unset_filesystem_defaults():
    p = resolve()
    assert p.read_roots == ("/workspace",)
    assert p.write_roots == ()
    assert p.blocked_paths == ()
    assert p.cwd == "/workspace"
    assert p.temp_dir == "/tmp"


def test_null_filesystem_is_the_same_as_unset():
    assert resolve({"filesystem": None}) == resolve()


def test_set_filesystem_is_taken_literally():
    p = resolve({"filesystem": {}})
    assert p.read_roots == () and p.write_roots == ()
    assert p.cwd == "/workspace" and p.temp_dir == "/tmp"


def test_default_network_is_no_egress():
    p = resolve()
    assert p.egress == "none"
    assert p.allow_domains == ()
    assert p.deny_private_networks is True


def test_default_limits_come_from_limit_settings():
    p = resolve(limits=LimitSettings())
    d = LimitSettings()
    assert p.timeout_ms == d.default_timeout_ms == 60_000
    assert p.memory_bytes == d.default_memory_mb * MB
    assert p.max_stdout_bytes == d.default_stdout_bytes
    assert p.max_stderr_bytes == d.default_stderr_bytes
    assert p.max_pids == d.default_pids
    assert p.cpu_millicores == d.default_cpu_millicores
    assert p.max_file_size_bytes == d.default_file_size_mb * MB
    assert p.tmp_size_bytes == d.default_tmp_size_mb * MB


def test_defaults_follow_custom_limit_settings():
    limits = LimitSettings(default_timeout_ms=1234, default_memory_mb=64, default_pids=7,
                           default_tmp_size_mb=3, max_cpu_millicores=8000)
    p = resolve(limits=limits)
    assert (p.timeout_ms, p.memory_bytes, p.max_pids, p.tmp_size_bytes) == (1234, 64 * MB, 7, 3 * MB)


def test_default_audit_records_everything():
    p = resolve()
    assert p.record_command and p.record_file_access and p.record_network_access


def test_default_env_is_exactly_the_base():
    assert resolve().env == {"PATH": BASE_PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}


def test_the_base_env_names_are_what_every_call_sets():
    # The Docker backend lets an image's ENV set only these (every call sets them over).
    assert tuple(sorted(resolve({}).env)) == BASE_ENV_NAMES


def test_home_and_tmpdir_follow_temp_dir():
    p = resolve({"filesystem": {"readRoots": ["/workspace"], "tempDir": "/scratch"}})
    assert p.env["HOME"] == "/scratch" and p.env["TMPDIR"] == "/scratch"


# ------------------------------------------------------------------ normalization


@pytest.mark.parametrize("raw, want", [
    ("/workspace", "/workspace"),
    ("//workspace//a", "/workspace/a"),
    ("/workspace/./a", "/workspace/a"),
    ("/workspace/a/", "/workspace/a"),
    ("/workspace/a/./b/../c", "/workspace/a/c"),
    ("a/../b", "/workspace/b"),
    ("a", "/workspace/a"),
    ("./a//b/", "/workspace/a/b"),
    (".", "/workspace"),
    ("../etc", "/etc"),
    ("/workspace/../etc/passwd", "/etc/passwd"),
    ("/../../workspace", "/workspace"),
    ("///", "/"),
])
def test_normalize_sandbox_path(raw, want):
    assert normalize_sandbox_path(raw, "f") == want


def test_normalize_relative_to_other_base():
    assert normalize_sandbox_path("tmp//x", "f", base="/") == "/tmp/x"


@pytest.mark.parametrize("raw", ["", "a\x00b", "/" + "a" * 4096])
def test_normalize_refuses_bad_paths_naming_the_field(raw):
    exc = refused(InvalidArgument, normalize_sandbox_path, raw, "policy.filesystem.readRoots[3]")
    assert exc.field == "policy.filesystem.readRoots[3]"


@pytest.mark.parametrize("path, root, want", [
    ("/workspace", "/workspace", True),
    ("/workspace/a", "/workspace", True),
    ("/workspace2", "/workspace", False),
    ("/workspac", "/workspace", False),
    ("/tmp/x", "/tmp/", True),
    ("/anything", "/", True),
])
def test_is_within(path, root, want):
    assert is_within(path, root) is want


def test_aliases_of_roots_are_deduplicated():
    p = resolve({"filesystem": {"readRoots": ["/workspace/src", "src", "//workspace/./src/", "a/../src"]}})
    assert p.read_roots == ("/workspace/src",)


def test_relative_roots_are_taken_from_workspace():
    p = resolve({"filesystem": {"readRoots": ["src"], "writeRoots": ["out/./x"], "blockedPaths": ["src/.env"]}})
    assert p.read_roots == ("/workspace/src",)
    assert p.write_roots == ("/workspace/out/x",)
    assert p.blocked_paths == ("/workspace/src/.env",)


@pytest.mark.parametrize("raw", ["../etc", "/workspace/../etc", "a/../../etc", "/etc", "//", "/workspace/../../../root"])
def test_write_root_escaping_workspace_is_refused(raw):
    exc = refused(InvalidArgument, resolve, {"filesystem": {"writeRoots": ["/workspace/ok", raw]}})
    assert exc.field == "policy.filesystem.writeRoots[1]"
    assert exc.status == "INVALID_ARGUMENT"


@pytest.mark.parametrize("raw", ["../etc", "/workspace/../home", "/tmp"])
def test_read_root_outside_workspace_is_refused(raw):
    exc = refused(InvalidArgument, resolve, {"filesystem": {"readRoots": [raw]}})
    assert exc.field == "policy.filesystem.readRoots[0]"


def test_write_root_in_temp_dir_is_allowed():
    p = resolve({"filesystem": {"writeRoots": ["/tmp/build", "/workspace/../tmp/cache"]}})
    assert p.write_roots == ("/tmp/build", "/tmp/cache")


def test_blocked_path_outside_workspace_is_refused():
    exc = refused(InvalidArgument, resolve, {"filesystem": {"readRoots": ["/workspace"], "blockedPaths": ["/tmp/x"]}})
    assert exc.field == "policy.filesystem.blockedPaths[0]"


def test_empty_root_is_refused_with_index():
    exc = refused(InvalidArgument, resolve, {"filesystem": {"readRoots": ["/workspace/a", ""]}})
    assert exc.field == "policy.filesystem.readRoots[1]"


def test_nul_in_root_is_refused_with_index():
    exc = refused(InvalidArgument, resolve, {"filesystem": {"blockedPaths": ["x\x00y"]}})
    assert exc.field == "policy.filesystem.blockedPaths[0]"


# ------------------------------------------------------------------ conflicts


def test_a_root_both_read_and_written_is_a_write_root():
    # The seed's policy as a client writes it literally: read-write, not a conflict.
    p = resolve({"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace"]}})
    assert p.read_roots == () and p.write_roots == ("/workspace",)


def test_a_root_both_read_and_written_via_an_alias_is_a_write_root():
    p = resolve({"filesystem": {"readRoots": ["/workspace/a", "/workspace/c"], "writeRoots": ["/workspace/b", "a/"]}})
    assert p.read_roots == ("/workspace/c",) and p.write_roots == ("/workspace/b", "/workspace/a")


def test_repeated_roots_collapse_in_both_lists():
    p = resolve({"filesystem": {"readRoots": ["src", "/workspace/src/", "/workspace/src", "/workspace"],
                                "writeRoots": ["out", "/workspace/out", "/workspace/out", "out/."]}})
    assert p.read_roots == ("/workspace",) and p.write_roots == ("/workspace/out",)


def test_a_read_root_inside_a_write_root_stays_a_read_only_part_of_it():
    # What the caller asked for, never more: out/sub stays read-only inside writable out.
    p = resolve({"filesystem": {"readRoots": ["/workspace/out/sub", "/workspace/src"], "writeRoots": ["/workspace/out"]}})
    assert p.read_roots == ("/workspace/out/sub", "/workspace/src") and p.write_roots == ("/workspace/out",)


def test_a_read_root_below_a_write_root_below_a_read_root_stays():
    # /workspace/a/b's nearest root is the write root /workspace/a, not the read root /workspace.
    p = resolve({"filesystem": {"readRoots": ["/workspace", "/workspace/a/b"], "writeRoots": ["/workspace/a"]}})
    assert p.read_roots == ("/workspace", "/workspace/a/b") and p.write_roots == ("/workspace/a",)
    q = resolve({"filesystem": {"readRoots": ["/workspace/a"], "writeRoots": ["/workspace", "/workspace/a/b"]}})
    assert q.read_roots == ("/workspace/a",) and q.write_roots == ("/workspace", "/workspace/a/b")


def test_a_root_inside_another_of_its_kind_is_dropped():
    p = resolve({"filesystem": {"readRoots": ["/workspace/a/b", "/workspace/a"],
                                "writeRoots": ["/workspace/o", "/workspace/o/deep/er", "/tmp/x/y", "/tmp/x"]}})
    assert p.read_roots == ("/workspace/a",) and p.write_roots == ("/workspace/o", "/tmp/x")


def test_a_sibling_that_only_shares_a_prefix_is_not_nested():
    p = resolve({"filesystem": {"readRoots": ["/workspace/outside"], "writeRoots": ["/workspace/out"]}})
    assert p.read_roots == ("/workspace/outside",) and p.write_roots == ("/workspace/out",)


@pytest.mark.parametrize("fs", [
    {"readRoots": ["/workspace", "/workspace/src"], "writeRoots": ["/workspace/out", "/workspace/out/y"]},
    {"readRoots": ["/workspace/src", "/workspace"], "writeRoots": ["/workspace/out/y", "/workspace/out"]},
    {"readRoots": ["/workspace/src", "/workspace"], "writeRoots": ["/workspace/out", "out/y", "out"]},
])
def test_normalized_roots_do_not_depend_on_the_order_given(fs):
    p = resolve({"filesystem": fs})
    assert p.read_roots == ("/workspace",) and p.write_roots == ("/workspace/out",)


def test_the_record_and_digest_leave_out_which_field_named_a_root():
    # Which entry named a root words refusals only: the same roots are the same policy.
    a = resolve({"filesystem": {"readRoots": ["/workspace", "/workspace/src"]}})
    b = resolve({"filesystem": {"readRoots": ["/workspace/src", "/workspace"]}})
    assert a.root_fields != b.root_fields
    assert "rootFields" not in a.to_json_dict() and a.digest() == b.digest()


def test_the_effective_policy_shows_the_normalized_roots():
    # What ToolArgsValidated records and ExplainPolicy returns.
    p = resolve({"filesystem": {"readRoots": ["/workspace", "/workspace/src/x"], "writeRoots": ["/workspace/src", "/workspace"]}})
    shown = p.to_json_dict()
    assert shown["readRoots"] == ["/workspace/src/x"] and shown["writeRoots"] == ["/workspace"]


def test_a_covered_root_inside_a_blocked_path_is_still_refused():
    exc = refused(InvalidArgument, resolve, {"filesystem": {
        "readRoots": ["/workspace/secret/inner"], "writeRoots": ["/workspace"], "blockedPaths": ["secret"]}})
    assert exc.field == "policy.filesystem.readRoots[0]"


def test_nested_read_and_write_roots_are_allowed():
    p = resolve({"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["/workspace/out"]}})
    assert p.read_roots == ("/workspace",) and p.write_roots == ("/workspace/out",)


def test_read_root_inside_blocked_path_is_refused():
    exc = refused(InvalidArgument, resolve, {"filesystem": {
        "readRoots": ["/workspace/ok", "/workspace/secret/inner"], "blockedPaths": ["secret"]}})
    assert exc.field == "policy.filesystem.readRoots[1]"


def test_write_root_equal_to_blocked_path_is_refused():
    exc = refused(InvalidArgument, resolve, {"filesystem": {
        "readRoots": ["/workspace/a"], "writeRoots": ["/workspace/b", "/workspace/c"], "blockedPaths": ["//workspace/c/"]}})
    assert exc.field == "policy.filesystem.writeRoots[1]"


def test_blocked_path_inside_root_is_fine():
    p = resolve({"filesystem": {"readRoots": ["/workspace"], "blockedPaths": ["/workspace/.env", "/workspace/.git"]}})
    assert p.blocked_paths == ("/workspace/.env", "/workspace/.git")


@pytest.mark.parametrize("raw", ["/workspace", "/workspace/.", "a/..", "//workspace/"])
def test_blocking_all_of_workspace_is_refused(raw):
    exc = refused(InvalidArgument, resolve, {"filesystem": {"readRoots": [], "blockedPaths": ["/workspace/x", raw]}})
    assert exc.field == "policy.filesystem.blockedPaths[1]"


# ------------------------------------------------------------------ cwd and tempDir


def test_cwd_relative_and_from_call():
    assert resolve({"filesystem": {"readRoots": ["/workspace"], "cwd": "sub"}}).cwd == "/workspace/sub"
    assert resolve(cwd="x/../y").cwd == "/workspace/y"


def test_call_cwd_wins_over_policy_cwd():
    p = resolve({"filesystem": {"readRoots": ["/workspace"], "cwd": "/workspace/a"}}, cwd="/workspace/b")
    assert p.cwd == "/workspace/b"


def test_cwd_in_temp_dir_is_allowed():
    assert resolve(cwd="/tmp/work").cwd == "/tmp/work"


@pytest.mark.parametrize("cwd", ["/etc", "../", "/workspace/../root", "/tmpfoo"])
def test_call_cwd_outside_workspace_and_temp_dir_is_refused(cwd):
    exc = refused(InvalidArgument, resolve, cwd=cwd)
    assert exc.field == "cwd"


def test_policy_cwd_outside_is_refused_with_policy_field():
    exc = refused(InvalidArgument, resolve, {"filesystem": {"readRoots": ["/workspace"], "cwd": "/etc"}})
    assert exc.field == "policy.filesystem.cwd"


def test_cwd_inside_blocked_path_is_refused():
    exc = refused(InvalidArgument, resolve, {"filesystem": {"readRoots": ["/workspace"], "blockedPaths": ["secret"]}},
                  cwd="/workspace/secret/sub")
    assert exc.field == "cwd"


@pytest.mark.parametrize("temp", ["/", "/.", "/workspace", "/workspace/tmp", "/tmp/../workspace/t",
                                  "/proc", "/proc/self", "/sys", "/sys/fs", "/dev", "/dev/shm"])
def test_bad_temp_dir_is_refused(temp):
    exc = refused(InvalidArgument, resolve, {"filesystem": {"readRoots": ["/workspace"], "tempDir": temp}})
    assert exc.field == "policy.filesystem.tempDir"


@pytest.mark.parametrize("temp, want", [("/scratch", "/scratch"), ("scratch", "/scratch"), ("/var/tmp/", "/var/tmp"),
                                        ("/procfoo", "/procfoo"), ("/workspace2", "/workspace2")])
def test_good_temp_dir(temp, want):
    assert resolve({"filesystem": {"readRoots": ["/workspace"], "tempDir": temp}}).temp_dir == want


def test_persist_outputs_is_part_of_the_effective_policy():
    kept = resolve({"filesystem": {"readRoots": ["/workspace"], "persistOutputs": True}})
    assert kept.persist_outputs and kept.to_json_dict()["persistOutputs"] is True
    assert not resolve({"filesystem": {"readRoots": ["/workspace"]}}).persist_outputs
    assert kept.digest() != resolve({"filesystem": {"readRoots": ["/workspace"]}}).digest()


# ------------------------------------------------------------------ network


def test_egress_allowlist_normalizes_and_dedupes_patterns():
    p = resolve({"network": {"egress": "allowlist",
                             "allowDomains": ["PyPI.org.", "*.Example.COM", "pypi.org", "10.0.0.5", "[::1]"]}})
    assert p.egress == "allowlist"
    assert p.allow_domains == ("pypi.org", "*.example.com", "10.0.0.5", "::1")
    assert p.deny_private_networks is True


@pytest.mark.parametrize("pattern, reason", [
    ("*", "wildcard"),
    ("*.com", "top-level"),
    ("*.co.uk", "public suffix"),
    ("*.github.io", "public suffix"),
    ("https://pypi.org", "scheme"),
    ("pypi.org:443", "port"),
    ("pypi.org/simple", "path"),
    ("py*.org", "wildcard"),
    ("*.*.example.com", "wildcard"),
    ("exa mple.com", "valid host"),
    ("-bad.example.com", "valid host"),
    ("", "empty"),
])
def test_bad_allow_domain_patterns_are_refused_with_the_index(pattern, reason):
    exc = refused(InvalidArgument, resolve, {"network": {"egress": "allowlist", "allowDomains": ["ok.test", pattern]}})
    assert exc.field == "policy.network.allowDomains[1]"
    assert reason in exc.message


@pytest.mark.parametrize("egress", ["none", "open"])
def test_allow_domains_without_allowlist_is_refused(egress):
    exc = refused(InvalidArgument, resolve, {"network": {"egress": egress, "allowDomains": ["example.com"],
                                                          "denyPrivateNetworks": False}})
    assert exc.field == "policy.network.allowDomains"


def test_unknown_egress_is_refused():
    exc = refused(InvalidArgument, resolve, {"network": {"egress": "everything"}})
    assert exc.field == "policy.network.egress"


def test_egress_open_without_private_network_filter_is_accepted():
    p = resolve({"network": {"egress": "open", "denyPrivateNetworks": False}})
    assert p.egress == "open" and p.deny_private_networks is False


@pytest.mark.parametrize("egress", ["none", "allowlist", "open"])
def test_lowering_deny_private_networks_is_refused_to_a_principal_the_operator_did_not_list(egress):
    network = {"egress": egress, "denyPrivateNetworks": False}
    if egress == "allowlist":
        network["allowDomains"] = ["a.test"]
    policy = resolve({"network": network})
    for principal, allowed in (("alice", ()), ("alice", ("bob",)), (None, ("alice",))):
        exc = refused(PermissionDenied, check_private_networks, policy, principal, allowed)
        assert exc.field == "policy.network.denyPrivateNetworks"
        assert "egress.private_networks_principals" in exc.reason and "not listed" in exc.reason
    check_private_networks(policy, "alice", ("bob", "alice"))
    check_private_networks(policy, "alice", ("*",))
    check_private_networks(policy, None, ("*",))


def test_keeping_deny_private_networks_needs_no_listing():
    for network in ({}, {"denyPrivateNetworks": True}, {"egress": "open"}):
        check_private_networks(resolve({"network": network}), "alice", ())


def test_egress_open_with_deny_private_networks_goes_through_the_proxy():
    # denyPrivateNetworks unset means true: only a proxy can check where a name resolves
    # to, so 'open' that must keep private addresses out is proxied, never a bare bridge.
    p = resolve({"network": {"egress": "open"}})
    assert p.egress == "open" and p.deny_private_networks is True and p.proxied
    assert not resolve({"network": {"egress": "open", "denyPrivateNetworks": False}}).proxied
    assert resolve({"network": {"egress": "allowlist", "allowDomains": ["a.test"]}}).proxied
    assert not resolve({"network": {"egress": "none"}}).proxied


# ------------------------------------------------------------------ limits


PROCESS_LIMITS = [
    ("timeoutMs", "max_timeout_ms", "timeout_ms", 1),
    ("maxMemoryMb", "max_memory_mb", "memory_bytes", MB),
    ("maxStdoutBytes", "max_output_bytes", "max_stdout_bytes", 1),
    ("maxStderrBytes", "max_output_bytes", "max_stderr_bytes", 1),
    ("maxPids", "max_pids", "max_pids", 1),
    ("cpuMillicores", "max_cpu_millicores", "cpu_millicores", 1),
    ("maxFileSizeMb", "max_file_size_mb", "max_file_size_bytes", MB),
    ("maxTmpSizeMb", "max_tmp_size_mb", "tmp_size_bytes", MB),
]


@pytest.mark.parametrize("name, max_attr, eff_attr, unit", PROCESS_LIMITS)
def test_limit_above_maximum_is_refused(name, max_attr, eff_attr, unit):
    maximum = getattr(LIMITS, max_attr)
    exc = refused(InvalidArgument, resolve, {"process": {name: maximum + 1}})
    assert exc.field == f"policy.process.{name}"
    assert str(maximum) in exc.reason


@pytest.mark.parametrize("name, max_attr, eff_attr, unit", PROCESS_LIMITS)
def test_limit_at_maximum_is_accepted(name, max_attr, eff_attr, unit):
    maximum = getattr(LIMITS, max_attr)
    # tempDir is memory: its maximum needs the memory to hold it.
    extra = {"maxMemoryMb": LIMITS.max_memory_mb} if name == "maxTmpSizeMb" else {}
    p = resolve({"process": {name: maximum, **extra}})
    assert getattr(p, eff_attr) == maximum * unit


@pytest.mark.parametrize("memory_mb, expected_tmp_mb", [(0, 256), (512, 256), (256, 192), (128, 96), (6, 5), (1, 1)])
def test_temp_dir_defaults_to_what_the_memory_limit_leaves(memory_mb, expected_tmp_mb):
    # The default (256 MB) shrinks so that a full tempDir leaves a quarter of the memory.
    p = resolve({"process": {"maxMemoryMb": memory_mb}} if memory_mb else None)
    assert p.tmp_size_bytes == expected_tmp_mb * MB


def test_a_temp_dir_the_memory_cannot_hold_is_refused_with_the_reason():
    exc = refused(InvalidArgument, resolve, {"process": {"maxMemoryMb": 128, "maxTmpSizeMb": 97}})
    assert exc.field == "policy.process.maxTmpSizeMb"
    assert "at most 96 MB" in exc.reason and "OOM" in exc.reason
    assert resolve({"process": {"maxMemoryMb": 128, "maxTmpSizeMb": 96}}).tmp_size_bytes == 96 * MB


@pytest.mark.parametrize("name, max_attr, eff_attr, unit", PROCESS_LIMITS)
def test_limit_zero_means_default(name, max_attr, eff_attr, unit):
    assert getattr(resolve({"process": {name: 0}}), eff_attr) == getattr(resolve(), eff_attr)


@pytest.mark.parametrize("name, max_attr, eff_attr, unit", PROCESS_LIMITS)
def test_negative_limit_is_refused(name, max_attr, eff_attr, unit):
    exc = refused(InvalidArgument, resolve, {"process": {name: -1}})
    assert exc.field == f"policy.process.{name}"


def test_explicit_limits_are_used():
    p = resolve({"process": {"timeoutMs": 5000, "maxMemoryMb": 64, "maxStdoutBytes": 10, "maxStderrBytes": 20,
                             "maxPids": 8, "cpuMillicores": 500, "maxFileSizeMb": 2, "maxTmpSizeMb": 4}})
    assert (p.timeout_ms, p.memory_bytes, p.max_stdout_bytes, p.max_stderr_bytes, p.max_pids, p.cpu_millicores,
            p.max_file_size_bytes, p.tmp_size_bytes) == (5000, 64 * MB, 10, 20, 8, 500, 2 * MB, 4 * MB)


def test_uint64_as_json_strings():
    p = resolve({"process": {"timeoutMs": "5000", "maxMemoryMb": "64"}})
    assert p.timeout_ms == 5000 and p.memory_bytes == 64 * MB


def test_uint64_string_above_maximum_is_refused():
    exc = refused(InvalidArgument, resolve, {"process": {"timeoutMs": "18446744073709551615"}})
    assert exc.field == "policy.process.timeoutMs"


def test_non_numeric_limit_is_refused():
    exc = refused(InvalidArgument, resolve, {"process": {"maxPids": "lots"}})
    assert exc.field == "policy.process.maxPids"


def test_proto_json_form_round_trip():
    """A PreparedToolCall built by the client, turned into proto JSON the way the
    service does (uint64 become strings), parses and resolves."""
    message = build_call(call_dict(
        toolCallId="tc-1", argv=["echo", "hi"],
        policy={"filesystem": {"readRoots": ["/workspace/src"], "writeRoots": ["/workspace/out"], "cwd": "src"},
                "process": {"timeoutMs": 5000, "maxStdoutBytes": 1024},
                "environment": {"injectedEnv": {"FOO": "bar"}},
                "network": {"egress": "none"}},
    ))
    raw = json_format.MessageToDict(message, preserving_proto_field_name=False)
    assert raw["policy"]["process"]["timeoutMs"] == "5000"  # what the wire form really is
    p = resolve_policy(parse_call(raw), LIMITS, {})
    assert p.timeout_ms == 5000 and p.max_stdout_bytes == 1024
    assert p.read_roots == ("/workspace/src",) and p.write_roots == ("/workspace/out",)
    assert p.cwd == "/workspace/src" and p.env["FOO"] == "bar"


# ------------------------------------------------------------------ environment


def test_inherited_env_only_from_the_mapping(monkeypatch):
    monkeypatch.setenv("TZ", "from-os-environ")
    p = resolve({"environment": {"inheritedEnv": ["TZ"]}}, inheritable={"TZ": "Europe/Paris"})
    assert p.env["TZ"] == "Europe/Paris"


def test_inherited_env_not_in_allowlist_is_permission_denied(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    exc = refused(PermissionDenied, resolve, {"environment": {"inheritedEnv": ["LANG", "SECRET_TOKEN"]}},
                  inheritable={"LANG": "C"})
    assert exc.field == "policy.environment.inheritedEnv[1]"
    assert exc.status == "PERMISSION_DENIED"
    assert "hunter2" not in exc.message


def test_real_environment_never_leaks(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2-value")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-value")
    p = resolve({"environment": {"inheritedEnv": ["LANG"], "injectedEnv": {"A": "b"}}}, inheritable={"LANG": "C"})
    assert set(p.env) == {"PATH", "HOME", "TMPDIR", "LANG", "A"}
    assert not {"hunter2-value", "aws-secret-value"} & set(p.env.values())


def test_inherited_env_none_value_is_skipped():
    p = resolve({"environment": {"inheritedEnv": ["TZ"]}}, inheritable={"TZ": None})
    assert "TZ" not in p.env


def test_injected_env_is_set_and_overrides_inherited():
    p = resolve({"environment": {"inheritedEnv": ["TZ"], "injectedEnv": {"TZ": "UTC", "X_1": ""}}},
                inheritable={"TZ": "Europe/Paris"})
    assert p.env["TZ"] == "UTC" and p.env["X_1"] == ""


@pytest.mark.parametrize("name", ["1ABC", "A-B", "A=B", "", "A B", "é", "A" * 257])
def test_invalid_injected_env_name_is_refused(name):
    exc = refused(InvalidArgument, resolve, {"environment": {"injectedEnv": {name: "v"}}})
    assert exc.field == f"policy.environment.injectedEnv.{name}"


@pytest.mark.parametrize("name", ["1ABC", "A-B", "A=B", ""])
def test_invalid_inherited_env_name_is_refused(name):
    exc = refused(InvalidArgument, resolve, {"environment": {"inheritedEnv": [name]}}, inheritable={name: "x"})
    assert exc.field == "policy.environment.inheritedEnv[0]"


def test_env_name_with_trailing_newline_is_refused():
    # `$` in _ENV_NAME_RE also matches before a trailing "\n".
    exc = refused(InvalidArgument, resolve, {"environment": {"injectedEnv": {"FOO\n": "v"}}})
    assert exc.field.startswith("policy.environment.injectedEnv.")


def test_nul_in_env_value_is_refused():
    exc = refused(InvalidArgument, resolve, {"environment": {"injectedEnv": {"OK": "x", "BAD": "a\x00b"}}})
    assert exc.field == "policy.environment.injectedEnv.BAD"


def test_non_string_env_value_is_refused():
    exc = refused(InvalidArgument, parse_call, call_dict(policy={"environment": {"injectedEnv": {"N": 5}}}))
    assert exc.field == "policy.environment.injectedEnv.N"


# ------------------------------------------------------------------ parse_call


def test_parse_call_camel_case():
    c = parse_call(call_dict(toolCallId="tc-1", sessionId="s", argv=["a", "b"], cwd="x", stdin=b"in",
                             runtime={"image": "sandboxd/default:latest", "adapter": "docker"}))
    assert c.tool_call_id == "tc-1" and c.session_id == "s" and c.argv == ["a", "b"]
    assert c.stdin == b"in" and c.runtime.image == "sandboxd/default:latest"


@pytest.mark.parametrize("data, field", [
    ({"bogus": 1}, "bogus"),
    ({"policy": {"bogus": 1}}, "policy.bogus"),
    ({"policy": {"filesystem": {"readRoot": ["/workspace"]}}}, "policy.filesystem.readRoot"),
    ({"policy": {"process": {"timeout": 1}}}, "policy.process.timeout"),
    ({"authorization": {"status": "granted", "whoever": "x"}}, "authorization.whoever"),
    ({"credentialRefs": [{"bindingId": "b", "envName": "E", "extra": 1}]}, "credentialRefs[0].extra"),
])
def test_unknown_fields_are_refused(data, field):
    exc = refused(InvalidArgument, parse_call, call_dict(**data))
    assert exc.field == field
    assert exc.reason == "unknown field"
    assert exc.message == f"{field}: unknown field"


@pytest.mark.parametrize("missing", ["toolId", "argv", "workspace"])
def test_required_fields(missing):
    data = call_dict()
    del data[missing]
    exc = refused(InvalidArgument, parse_call, data)
    assert exc.field == missing


def test_more_problems_are_counted():
    exc = refused(InvalidArgument, parse_call, {"argv": ["x"]})
    assert "(and 1 more problem)" in exc.reason


def test_list_index_in_field_path():
    exc = refused(InvalidArgument, parse_call, call_dict(policy={"filesystem": {"readRoots": ["/workspace", 3]}}))
    assert exc.field == "policy.filesystem.readRoots[1]"


def test_wrong_type_nested_field():
    exc = refused(InvalidArgument, parse_call, call_dict(policy={"audit": {"recordCommand": "maybe"}}))
    assert exc.field == "policy.audit.recordCommand"


@pytest.mark.parametrize("argv, field", [([], "argv"), ([""], "argv"), (["echo", "a\x00b"], "argv[1]"),
                                         (["\x00"], "argv[0]")])
def test_bad_argv_is_refused(argv, field):
    exc = refused(InvalidArgument, parse_call, call_dict(argv=argv))
    assert exc.field == field


@pytest.mark.parametrize("tcid", ["-x", ".x", "a b", "a/b", "x" * 129, "a\x00"])
def test_bad_tool_call_id_is_refused(tcid):
    exc = refused(InvalidArgument, parse_call, call_dict(toolCallId=tcid))
    assert exc.field == "toolCallId"


def test_tool_call_id_with_trailing_newline_is_refused():
    # `$` in _ID_RE matches before a final "\n": "tc-1\n" passes the check and would
    # end up in container labels and gRPC metadata.
    exc = refused(InvalidArgument, parse_call, call_dict(toolCallId="tc-1\n"))
    assert exc.field == "toolCallId"


@pytest.mark.parametrize("tcid", ["a", "tc_0123:abc.def-9", "x" * 128])
def test_good_tool_call_id(tcid):
    assert parse_call(call_dict(toolCallId=tcid)).tool_call_id == tcid


def test_unknown_adapter_is_refused():
    exc = refused(InvalidArgument, parse_call, call_dict(runtime={"adapter": "lxc"}))
    assert exc.field == "runtime.adapter"


def test_parse_policy_prefixes_field():
    exc = refused(InvalidArgument, parse_policy, {"process": {"maxPids": -3}})
    assert exc.field == "policy.process.maxPids"
    assert parse_policy(None).filesystem is None


# ------------------------------------------------------------------ admission


NOW = datetime(2030, 1, 1, 12, 0, tzinfo=timezone.utc)


def admit(**fields):
    check_admission(parse_call(call_dict(**fields)), now=NOW)


@pytest.mark.parametrize("status", ["granted", "not_required"])
def test_admission_accepts(status):
    admit(authorization={"status": status})


@pytest.mark.parametrize("status", ["", "denied", "pending", "GRANTED", "granted "])
def test_admission_refuses_other_status(status):
    exc = refused(PermissionDenied, admit, authorization={"status": status})
    assert exc.field == "authorization.status"
    assert exc.status == "PERMISSION_DENIED"


def test_admission_refuses_missing_authorization():
    data = call_dict()
    del data["authorization"]
    with pytest.raises(PermissionDenied):
        check_admission(parse_call(data), now=NOW)


@pytest.mark.parametrize("expires", [
    (NOW - timedelta(seconds=1)).isoformat(), NOW.isoformat(), "2029-12-31T23:59:59Z", "2030-01-01T13:00:00+02:00",
])
def test_expired_grant_is_refused(expires):
    exc = refused(PermissionDenied, admit, authorization={"status": "granted", "expiresAt": expires})
    assert exc.field == "authorization.expiresAt"


@pytest.mark.parametrize("expires", ["2030-01-01T12:00:01Z", "2030-01-01T13:00:00+00:30", "2031-06-01T00:00:00.123456Z"])
def test_unexpired_grant_is_accepted(expires):
    admit(authorization={"status": "granted", "expiresAt": expires})


@pytest.mark.parametrize("expires", ["tomorrow", "2030-13-01T00:00:00Z"])
def test_unparseable_expiry_is_invalid(expires):
    exc = refused(InvalidArgument, admit, authorization={"status": "granted", "expiresAt": expires})
    assert exc.field == "authorization.expiresAt"


def test_expiry_without_timezone_is_invalid():
    exc = refused(InvalidArgument, admit, authorization={"status": "granted", "expiresAt": "2031-01-01T00:00:00"})
    assert exc.field == "authorization.expiresAt"


def test_expiry_uses_real_clock_by_default():
    past = (datetime.now(timezone.utc) - timedelta(minutes=1)).isoformat()
    with pytest.raises(PermissionDenied):
        check_admission(parse_call(call_dict(authorization={"status": "granted", "expiresAt": past})))


def test_authorization_is_checked_first():
    exc = refused(PermissionDenied, admit, authorization={"status": "denied"}, runtime={"leaseId": "l"})
    assert exc.field == "authorization.status"


def test_docker_adapter_is_admitted():
    admit(runtime={"adapter": "docker"})


# ------------------------------------------------------------------ EffectivePolicy


def test_effective_policy_json_is_camel_case():
    d = resolve({"filesystem": {"readRoots": ["/workspace"]}, "process": {"maxMemoryMb": 1}}).to_json_dict()
    assert d["readRoots"] == ["/workspace"]
    assert d["memoryBytes"] == MB
    assert d["tempDir"] == "/tmp"
    assert d["denyPrivateNetworks"] is True
    assert all("_" not in k for k in d)


def test_effective_policy_digest_is_stable_and_sensitive():
    a, b = resolve(), resolve()
    assert a.digest() == b.digest()
    assert a.digest().startswith("sha256:") and len(a.digest()) == 7 + 64
    assert resolve({"process": {"maxPids": 9}}).digest() != a.digest()


def test_effective_policy_is_frozen():
    p = resolve()
    with pytest.raises(Exception):
        p.cwd = "/etc"  # type: ignore[misc]
    assert isinstance(p, EffectivePolicy)


def test_error_message_format():
    exc = refused(InvalidArgument, resolve, {"process": {"timeoutMs": LIMITS.max_timeout_ms + 1}})
    assert exc.message.startswith("policy.process.timeoutMs: ")
    assert str(exc) == exc.message


def test_request_digest_binds_what_runs_not_the_ids_a_retry_may_change():
    from sandboxd.policy.models import request_digest

    base = request_digest(parse_call(call_dict(toolCallId="tc-a", sessionId="s1")))
    assert base == request_digest(parse_call(call_dict(toolCallId="tc-b", sessionId="s2")))
    assert base != request_digest(parse_call(call_dict(argv=["echo", "other"])))
    assert base != request_digest(parse_call(call_dict(policy={"process": {"timeoutMs": 1234}})))
    assert base != request_digest(parse_call(call_dict(stdin=b"input")))
    assert base.startswith("sha256:") and len(base) == 71


def test_a_call_names_at_most_sixteen_credentials():
    refs = [{"bindingId": f"b{i}", "envName": f"E{i}"} for i in range(17)]
    exc = refused(InvalidArgument, parse_call, {**call_dict(), "credentialRefs": refs})
    assert exc.field == "credentialRefs"
    assert len(parse_call({**call_dict(), "credentialRefs": refs[:16]}).credential_refs) == 16


# -- every string of a request: no NUL, a bounded length (issue 20) -------------------
@pytest.mark.parametrize("patch, field", [
    ({"workspace": "/srv/ws\x00/etc"}, "workspace"),
    ({"runtime": {"image": "sandboxd/default\x00x"}}, "runtime.image"),
    ({"credentialRefs": [{"bindingId": "gh", "filePath": "/tmp/a\x00b"}]}, "credentialRefs[0].filePath"),
    ({"cwd": "/workspace/\x00"}, "cwd"),
    ({"policy": {"filesystem": {"readRoots": ["/workspace", "/workspace/a\x00"]}}}, "policy.filesystem.readRoots[1]"),
    ({"policy": {"environment": {"injectedEnv": {"A": "x\x00y"}}}}, "policy.environment.injectedEnv.A"),
    ({"sessionId": "s\x00"}, "sessionId"),
])
def test_a_nul_byte_anywhere_is_an_invalid_argument_naming_the_field(patch, field):
    raw = {"toolId": "t", "argv": ["true"], "workspace": "/srv/ws", **patch}
    with pytest.raises(InvalidArgument) as exc:
        parse_call(raw)
    assert exc.value.field == field and "NUL" in exc.value.reason


@pytest.mark.parametrize("patch, field, limit", [
    ({"toolId": "t" * (MAX_FIELD_CHARS + 1)}, "toolId", MAX_FIELD_CHARS),
    ({"authorization": {"signature": "s" * (MAX_FIELD_CHARS + 1)}}, "authorization.signature", MAX_FIELD_CHARS),
    ({"argv": ["echo", "a" * (MAX_ARG_CHARS + 1)]}, "argv[1]", MAX_ARG_CHARS),
    ({"policy": {"environment": {"injectedEnv": {"A": "v" * (MAX_ENV_VALUE_CHARS + 1)}}}},
     "policy.environment.injectedEnv.A", MAX_ENV_VALUE_CHARS),
])
def test_every_string_has_a_maximum_length(patch, field, limit):
    raw = {"toolId": "t", "argv": ["true"], "workspace": "/srv/ws", **patch}
    with pytest.raises(InvalidArgument) as exc:
        parse_call(raw)
    assert exc.value.field == field and str(limit) in exc.value.reason
    at_limit = {k: v for k, v in raw.items()}
    # One character less is accepted (the limit is the limit, not a round figure near it).
    if field == "argv[1]":
        at_limit["argv"] = ["echo", "a" * MAX_ARG_CHARS]
        assert parse_call(at_limit).argv[1] == "a" * MAX_ARG_CHARS


def test_the_injected_environment_has_a_total_maximum():
    from sandboxd.policy.models import MAX_ENV_TOTAL_CHARS

    value = "v" * (MAX_ENV_VALUE_CHARS - 16)
    count = MAX_ENV_TOTAL_CHARS // len(value) + 1
    raw = {"toolId": "t", "argv": ["true"], "workspace": "/srv/ws",
           "policy": {"environment": {"injectedEnv": {f"V{i}": value for i in range(count)}}}}
    with pytest.raises(InvalidArgument) as exc:
        parse_call(raw)
    assert exc.value.field == "policy.environment.injectedEnv" and str(MAX_ENV_TOTAL_CHARS) in exc.value.reason
    raw["policy"]["environment"]["injectedEnv"] = {f"V{i}": value for i in range(count - 1)}
    assert len(parse_call(raw).policy.environment.injected_env) == count - 1
