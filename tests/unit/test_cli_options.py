"""`sandboxctl`'s options beside exec's: the connection options on every command,
--version, named contexts of the client config file, and the completion script (run
in a real bash). No daemon."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import sandboxd_client
from sandboxd_client import cli
from sandboxd_client.cli_parser import build_parser
from sandboxd_client.completion import walk
from sandboxd_client.contexts import ConfigError, Target, load_config, resolve_target

SANDBOXCTL = str(Path(sys.executable).with_name("sandboxctl"))
CLIENT = Path(sandboxd_client.__file__).parent


def leaf_commands() -> list[list[str]]:
    """Every runnable command's words, with what its positionals need."""
    needs = {"artifact get": ["a"], "artifact ls": ["c"], "trace": ["c"], "logs": ["c"], "diff": ["c"], "cancel": ["c"],
             "pool release": ["l"], "context use": ["n"], "context set": ["n"], "context rm": ["n"],
             "completion": ["bash"], "exec": ["--", "true"], "cp": ["a", "b"]}
    return [c.path.split() + needs.get(c.path, []) for c in walk(build_parser()) if c.path and not c.subcommands]


@pytest.mark.parametrize("words", leaf_commands(), ids=" ".join)
def test_every_command_takes_socket_before_and_after_it(words):
    parser = build_parser()
    before = parser.parse_args(["--socket", "/run/a.sock", *words])
    cut = words.index("--") if "--" in words else len(words)
    after = parser.parse_args([*words[:cut], "--socket", "/run/b.sock", *words[cut:]])
    assert (before.socket, after.socket) == ("/run/a.sock", "/run/b.sock")


def test_audit_takes_socket_after_the_command():
    # It had no connection options of its own: `audit --socket S` was an error.
    args = build_parser().parse_args(["audit", "--socket", "/run/x.sock", "--status", "error"])
    assert args.socket == "/run/x.sock" and args.status == "error"


def test_version():
    out = subprocess.run([SANDBOXCTL, "--version"], capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stdout) == (0, f"sandboxctl {sandboxd_client.__version__}\n")
    assert sandboxd_client.__version__ == "0.1.0"


# ------------------------------------------------------------------ contexts


def write_config(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def target(args: list[str], environ: dict | None = None) -> Target:
    return resolve_target(build_parser().parse_args([*args, "ps"]), environ or {})


@pytest.fixture
def config(tmp_path) -> Path:
    for name in ("ca.pem", "me.pem", "me.key"):
        (tmp_path / name).write_text("x")
    return write_config(tmp_path / "client.yaml", {
        "current_context": "prod",
        "contexts": {"prod": {"address": "10.0.0.5:7443", "ca": "ca.pem", "cert": "me.pem", "key": "me.key"},
                     "local": {"socket": "/run/other.sock"}}})


def test_the_current_context_holds_the_tls_files(config, tmp_path):
    t = target(["--config", str(config)])
    assert t.address == "10.0.0.5:7443" and t.tls is not None
    # Relative paths are the file's directory's.
    assert (t.tls.ca_file, t.tls.cert_file, t.tls.key_file) == tuple(str(tmp_path / n) for n in
                                                                     ("ca.pem", "me.pem", "me.key"))


def test_the_order_of_what_says_where_to_connect(config):
    env = {"SANDBOXD_CLIENT_CONFIG": str(config)}
    assert target([], env).address == "10.0.0.5:7443"
    assert target(["--context", "local"], env) == Target(socket="/run/other.sock")
    assert target([], {**env, "SANDBOXD_CONTEXT": "local"}).socket == "/run/other.sock"
    assert target([], {**env, "SANDBOXD_SOCKET": "/run/env.sock"}).socket == "/run/env.sock"
    assert target(["--context", "prod"], {**env, "SANDBOXD_SOCKET": "/run/env.sock"}).address == "10.0.0.5:7443"
    assert target(["--socket", "/run/flag.sock"], {**env, "SANDBOXD_CONTEXT": "prod"}).socket == "/run/flag.sock"
    assert target(["--context", "default"], env).socket  # the built-in one: the default socket


def test_no_config_file_means_the_default_socket(tmp_path):
    t = target([], {"SANDBOXD_CLIENT_CONFIG": str(tmp_path / "missing.yaml")})
    assert t.tls is None and t.socket


@pytest.mark.parametrize("args, reason", [
    (["--context", "prod", "--socket", "/s"], "--context and --socket/--tcp"),
    (["--socket", "/s", "--tcp", "h:1"], "--socket and --tcp"),
    (["--tls-ca", "ca.pem"], "--tls-ca goes with --tcp"),
    (["--tcp", "h:1", "--tls-ca", "ca.pem"], "--tcp needs --tls-cert, --tls-key"),
    (["--context", "staging"], "no context 'staging'"),
])
def test_conflicting_or_unknown_connection_options(config, args, reason):
    with pytest.raises(ConfigError, match=reason):
        target(["--config", str(config), *args])


@pytest.mark.parametrize("data, field", [
    ({"contexts": {"x": {"address": "h:1", "ca": "c"}}}, "contexts.x.cert: required with address"),
    ({"contexts": {"x": {"socket": "/s", "address": "h:1"}}}, "contexts.x: give exactly one"),
    ({"contexts": {"x": {}}}, "contexts.x: give exactly one"),
    ({"contexts": {"x": {"socket": "/s", "ca": "c"}}}, "contexts.x: ca, cert and key go with address"),
    ({"contexts": {"x": {"socket": "/s", "port": 1}}}, "contexts.x.port: unknown"),
    ({"contexts": {"x": {"socket": 5}}}, "contexts.x.socket: must be a non-empty string"),
    ({"contexts": {"bad name": {"socket": "/s"}}}, "is not a context name"),
    ({"contexts": {"default": {"socket": "/s"}}}, "the built-in context"),
    ({"contexts": {"x": "/s"}}, "contexts.x: must be a mapping"),
    ({"current_context": "y", "contexts": {"x": {"socket": "/s"}}}, "current_context: no context 'y'"),
    ({"contexts": {}, "extra": 1}, "extra: unknown"),
])
def test_a_bad_config_file_is_refused_with_the_field(tmp_path, data, field):
    with pytest.raises(ConfigError, match=field):
        load_config(write_config(tmp_path / "client.yaml", data))


def ctl(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SANDBOXD_CLIENT_CONFIG": str(tmp_path / "conf" / "client.yaml")}
    env.pop("SANDBOXD_CONTEXT", None)
    return subprocess.run([SANDBOXCTL, *args], capture_output=True, text=True, timeout=30, env=env)


def test_context_set_use_ls_rm(tmp_path):
    path = tmp_path / "conf" / "client.yaml"
    assert ctl(tmp_path, "context", "set", "lab", "--tcp", "127.0.0.1:7443", "--tls-ca", "ca.pem",
               "--tls-cert", "me.pem", "--tls-key", "me.key").returncode == 0
    assert ctl(tmp_path, "context", "set", "sock", "--socket", "/run/s.sock").returncode == 0
    assert oct(path.stat().st_mode & 0o777) == "0o600"  # it names key files
    saved = yaml.safe_load(path.read_text())
    assert saved["contexts"]["lab"] == {"address": "127.0.0.1:7443", "ca": os.path.abspath("ca.pem"),
                                        "cert": os.path.abspath("me.pem"), "key": os.path.abspath("me.key")}
    assert "current_context" not in saved

    assert ctl(tmp_path, "context", "use", "lab").returncode == 0
    assert yaml.safe_load(path.read_text())["current_context"] == "lab"
    listed = ctl(tmp_path, "context", "ls").stdout.splitlines()
    assert [line.split()[:2] for line in listed if line.startswith("*")] == [["*", "lab"]]
    as_json = json.loads(ctl(tmp_path, "context", "ls", "--json").stdout)
    assert [c["name"] for c in as_json] == ["default", "lab", "sock"] and as_json[1]["current"]

    missing = ctl(tmp_path, "context", "use", "nope")
    assert missing.returncode == 1 and "no context 'nope'" in missing.stderr
    assert ctl(tmp_path, "context", "rm", "lab").returncode == 0
    assert "current_context" not in yaml.safe_load(path.read_text())
    assert ctl(tmp_path, "context", "use", "default").returncode == 0


def test_context_set_refuses_half_a_tls_setup(tmp_path):
    out = ctl(tmp_path, "context", "set", "lab", "--tcp", "127.0.0.1:7443", "--tls-ca", "ca.pem")
    assert out.returncode == 2 and "--tls-cert" in out.stderr
    assert not (tmp_path / "conf" / "client.yaml").exists()


def test_a_bad_config_file_stops_a_command_before_it_connects(tmp_path, capsys):
    bad = write_config(tmp_path / "client.yaml", {"contexts": {"x": {"address": "h:1"}}})
    assert cli.main(["--config", str(bad), "ps"]) == cli.EXIT_REFUSED
    assert "contexts.x.ca: required with address" in capsys.readouterr().err


# ------------------------------------------------------------------ completion


def complete(script: str, *words: str) -> list[str]:
    """What the generated bash function offers for `words` (the last one being typed)."""
    quoted = " ".join("'" + w.replace("'", "'\\''") + "'" for w in words)
    probe = f"{script}\nCOMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; _sandboxctl; printf '%s\\n' \"${{COMPREPLY[@]}}\"\n"
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


@pytest.fixture(scope="module")
def bash_script() -> str:
    out = subprocess.run([SANDBOXCTL, "completion", "bash"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    return out.stdout


def test_bash_completion(bash_script):
    assert {"exec", "ps", "logs", "cancel", "context", "completion"} <= set(complete(bash_script, "sandboxctl", ""))
    assert complete(bash_script, "sandboxctl", "--socket", "/run/x.sock", "pool", "ac") == ["acquire"]
    assert complete(bash_script, "sandboxctl", "exec", "--net") == ["--network"]
    assert complete(bash_script, "sandboxctl", "exec", "--network", "") == ["none", "open"]
    assert complete(bash_script, "sandboxctl", "exec", "-e", "A=1", "--re") == ["--read-only", "--result-json"]
    assert complete(bash_script, "sandboxctl", "logs", "--f") == ["--follow"]
    assert complete(bash_script, "sandboxctl", "completion", "") == ["bash", "zsh"]


def test_every_option_is_completed(bash_script):
    """Generated from the parser: a new option is offered without anyone editing it."""
    for command in walk(build_parser()):
        words = ["sandboxctl", *command.path.split(), "-"]
        assert set(complete(bash_script, *words)) == set(command.options), command.path


def test_zsh_completion_runs_the_bash_function_through_bashcompinit(bash_script):
    out = subprocess.run([SANDBOXCTL, "completion", "zsh"], capture_output=True, text=True, timeout=30)
    assert out.stdout.startswith("#compdef sandboxctl\n") and "bashcompinit" in out.stdout
    assert out.stdout.endswith(bash_script)


# ------------------------------------------------------------------ shape


def test_no_client_module_over_500_lines_or_function_over_80():
    for path in sorted(CLIENT.glob("*.py")):
        text = path.read_text()
        assert len(text.splitlines()) <= 500, path.name
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 <= 80, f"{path.name}: {node.name}"


def test_a_negative_since_byte_is_refused_before_connecting(tmp_path, capsys):
    assert cli.main(["logs", "--socket", str(tmp_path / "none.sock"), "--since-byte", "-1", "tc_x"]) == 2
    err = capsys.readouterr().err
    assert "--since-byte" in err and "UNAVAILABLE" not in err


def test_a_reader_that_goes_away_ends_sandboxctl_quietly():
    """`sandboxctl ... | head`: no traceback and no "[Errno 32] Broken pipe" (exit 125); the
    exit a command killed by SIGPIPE has."""
    import subprocess
    import sys

    # A command that prints more than a pipe holds (as `ps` or `audit` may).
    code = ("import argparse, sys; from sandboxd_client import cli\n"
            "parser = argparse.ArgumentParser()\n"
            "parser.set_defaults(func=lambda args: [print('row ' * 50) for _ in range(10_000)] and 0)\n"
            "cli.build_parser = lambda: parser\n"
            "sys.exit(cli.main([]))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.read(10)
    proc.stdout.close()  # the reader goes away after its first bytes
    _, stderr = proc.communicate(timeout=30)
    assert (proc.returncode, stderr) == (141, b"")


def test_a_daemon_that_is_not_there_is_named_as_such(tmp_path, capsys):
    from sandboxd_client.cli import main

    assert main(["ps", "--socket", str(tmp_path / "none.sock")]) == 1
    said = capsys.readouterr().err
    assert said.startswith("sandboxctl: UNAVAILABLE: ") and "is sandboxd running, or still starting?" in said


def test_audit_takes_a_time_ago_as_well_as_rfc_3339():
    from datetime import datetime, timezone

    from sandboxd_client.cli_parser import build_parser
    from sandboxd_client.cli_records import point_in_time

    now = datetime(2026, 12, 7, 12, 0, 0, tzinfo=timezone.utc)
    assert point_in_time("1h", now) == "2026-12-07T11:00:00Z"
    assert point_in_time("90m", now) == "2026-12-07T10:30:00Z"
    assert point_in_time("2d", now) == "2026-12-05T12:00:00Z"
    assert point_in_time("1w", now) == "2026-11-30T12:00:00Z"
    assert point_in_time("2026-12-01T00:00:00Z", now) == "2026-12-01T00:00:00Z"  # as given
    args = build_parser().parse_args(["audit", "--since", "1h"])
    assert args.since.endswith("Z") and args.since != "1h"
