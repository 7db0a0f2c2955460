"""`sandboxctl exec`'s flags made into the call (pure: no daemon), and the refusals of a
flag that contradicts the policy file, naming both the flag and the field."""

from __future__ import annotations

import json
import os

import pytest

from sandboxd_client import cli
from sandboxd_client.cli_exec import FlagConflict, exec_call, parse_network, policy_with_flags
from sandboxd_client.cli_parser import build_parser
from sandboxd_client.client import build_call


def call_for(tmp_path, *flags: str, policy: dict | None = None) -> dict:
    argv = list(flags)
    if policy is not None:
        p = tmp_path / "policy.json"
        p.write_text(json.dumps(policy))
        argv = ["--policy", str(p), *argv]
    args = build_parser().parse_args(["exec", "--workspace", str(tmp_path), *argv, "--", "true"])
    return exec_call(args, ["true"])


def test_env_flags_become_injected_env(tmp_path):
    c = call_for(tmp_path, "-e", "A=1", "--env", "B=x=y", "-e", "EMPTY=")
    assert c["policy"] == {"environment": {"injectedEnv": {"A": "1", "B": "x=y", "EMPTY": ""}}}
    assert build_call(c).policy.environment.injected_env["B"] == "x=y"


def test_env_fills_a_policy_and_may_repeat_its_value(tmp_path):
    policy = {"environment": {"injectedEnv": {"A": "1"}, "inheritedEnv": ["LANG"]}}
    c = call_for(tmp_path, "-e", "A=1", "-e", "B=2", policy=policy)
    assert c["policy"]["environment"] == {"injectedEnv": {"A": "1", "B": "2"}, "inheritedEnv": ["LANG"]}


def test_write_roots_keep_the_workspace_readable(tmp_path):
    c = call_for(tmp_path, "-w", "out", "--write", "/workspace/build", "-w", "/tmp/cache")
    assert c["policy"] == {"filesystem": {"readRoots": ["/workspace"],
                                          "writeRoots": ["out", "/workspace/build", "/tmp/cache"]}}
    assert list(build_call(c).policy.filesystem.write_roots) == ["out", "/workspace/build", "/tmp/cache"]


def test_write_fills_a_filesystem_section_literally(tmp_path):
    # The file's section is taken as written: its roots, plus the flag's.
    c = call_for(tmp_path, "-w", "out", policy={"filesystem": {"readRoots": ["src"], "blockedPaths": [".env"]}})
    assert c["policy"]["filesystem"] == {"readRoots": ["src"], "blockedPaths": [".env"], "writeRoots": ["out"]}


@pytest.mark.parametrize("value, network", [
    ("none", {"egress": "none"}),
    ("open", {"egress": "open"}),
    ("pypi.org", {"egress": "allowlist", "allowDomains": ["pypi.org"]}),
    ("pypi.org,*.pythonhosted.org", {"egress": "allowlist", "allowDomains": ["pypi.org", "*.pythonhosted.org"]}),
    ("a.test, b.test", {"egress": "allowlist", "allowDomains": ["a.test", "b.test"]}),
])
def test_network_flag(tmp_path, value, network):
    c = call_for(tmp_path, "--network", value)
    assert c["policy"] == {"network": network}
    assert build_call(c).policy.network.egress == network["egress"]


def test_network_keeps_the_policys_other_network_fields(tmp_path):
    c = call_for(tmp_path, "--network", "open", policy={"network": {"denyPrivateNetworks": False}})
    assert c["policy"]["network"] == {"denyPrivateNetworks": False, "egress": "open"}


@pytest.mark.parametrize("value", ["", ",", "a.test,", "a.test,,b.test"])
def test_a_bad_network_value_is_refused(value):
    with pytest.raises(FlagConflict, match="--network"):
        parse_network(value)


def test_read_only(tmp_path):
    assert call_for(tmp_path, "--read-only")["policy"] == {"filesystem": {"readRoots": ["/workspace"],
                                                                          "writeRoots": []}}
    narrowed = call_for(tmp_path, "--read-only", policy={"filesystem": {"readRoots": ["src"]}})
    assert narrowed["policy"]["filesystem"] == {"readRoots": ["src"], "writeRoots": []}


def test_flags_agreeing_with_the_policy_are_no_contradiction(tmp_path):
    policy = {"filesystem": {"readRoots": ["/workspace"], "writeRoots": ["out"]},
              "network": {"egress": "allowlist", "allowDomains": ["b.test", "a.test"]},
              "process": {"timeoutMs": "5000"}}
    c = call_for(tmp_path, "-w", "out", "--network", "a.test,b.test", "--timeout-ms", "5000", policy=policy)
    assert c["policy"]["filesystem"]["writeRoots"] == ["out"] and c["policy"]["process"]["timeoutMs"] == 5000


@pytest.mark.parametrize("policy, flags, named", [
    ({"network": {"egress": "none"}}, ["--network", "open"], ("--network open", "policy.network.egress")),
    ({"network": {"egress": "allowlist", "allowDomains": ["a.test"]}}, ["--network", "open"],
     ("--network open", "policy.network.egress")),
    ({"network": {"egress": "allowlist", "allowDomains": ["a.test"]}}, ["--network", "b.test"],
     ("--network b.test", "policy.network.allowDomains")),
    ({"network": {"allowDomains": ["a.test"]}}, ["--network", "none"], ("--network none", "policy.network.allowDomains")),
    ({"filesystem": {"writeRoots": ["out"]}}, ["-w", "build"], ("-w/--write build", "policy.filesystem.writeRoots")),
    ({"filesystem": {"writeRoots": []}}, ["-w", "build"], ("-w/--write build", "policy.filesystem.writeRoots")),
    ({"filesystem": {"writeRoots": ["out"]}}, ["--read-only"], ("--read-only", "policy.filesystem.writeRoots")),
    ({"environment": {"injectedEnv": {"MODE": "prod"}}}, ["-e", "MODE=dev"],
     ("-e MODE=", "policy.environment.injectedEnv.MODE")),
    ({"process": {"timeoutMs": 1000}}, ["--timeout-ms", "9000"], ("--timeout-ms 9000", "policy.process.timeoutMs")),
    ({"process": {"maxMemoryMb": 64}}, ["--memory-mb", "512"], ("--memory-mb 512", "policy.process.maxMemoryMb")),
])
def test_a_flag_contradicting_the_policy_is_refused_naming_both(tmp_path, capsys, policy, flags, named):
    p = tmp_path / "policy.json"
    p.write_text(json.dumps(policy))
    # No daemon: the refusal comes before any connection (a socket that does not exist).
    code = cli.main(["exec", "--socket", str(tmp_path / "none.sock"), "--workspace", str(tmp_path),
                     "--policy", str(p), *flags, "--", "true"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_REFUSED
    flag, field = named
    assert flag in err and field in err, err
    assert "UNAVAILABLE" not in err  # refused here, not by a failed connection


def test_an_env_value_of_the_policy_is_not_shown_in_the_refusal(tmp_path):
    with pytest.raises(FlagConflict) as exc:
        policy_with_flags({"environment": {"injectedEnv": {"TOKEN": "s3cret-value"}}}, env=["TOKEN=other"])
    assert "s3cret-value" not in str(exc.value) and "other" not in str(exc.value)


def test_read_only_and_write_contradict_each_other():
    with pytest.raises(FlagConflict, match="--read-only contradicts -w/--write"):
        policy_with_flags({}, write=["out"], read_only=True)


def test_the_policy_file_is_not_changed_in_place():
    policy = {"environment": {"injectedEnv": {"A": "1"}}, "process": None}
    policy_with_flags(policy, env=["B=2"], timeout_ms=5)
    assert policy == {"environment": {"injectedEnv": {"A": "1"}}, "process": None}


@pytest.mark.parametrize("policy", [{"network": "open"}, {"filesystem": ["/workspace"]}])
def test_a_section_that_is_no_mapping_is_refused(policy):
    with pytest.raises(ValueError, match="must be a mapping"):
        policy_with_flags(policy, network="none")


def test_result_json_goes_to_its_file_only(tmp_path):
    args = build_parser().parse_args(["exec", "--result-json", str(tmp_path / "r.json"), "--", "true"])
    assert args.result_json == str(tmp_path / "r.json") and not args.json


def test_write_result_json_is_whole(tmp_path):
    from sandboxd_client.cli_exec import write_result_json
    from sandboxd_contract.pb import sandboxd_pb2 as pb

    target = tmp_path / "result.json"
    target.write_text("an older result")
    write_result_json(str(target), pb.ToolResult(tool_call_id="tc_1", status="success", exit_code=3))
    data = json.loads(target.read_text())
    assert data["toolCallId"] == "tc_1" and data["exitCode"] == 3 and data["status"] == "success"
    assert os.listdir(tmp_path) == ["result.json"]  # no temporary file left
