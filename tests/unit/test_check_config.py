"""sandboxd.check.config: a config file loaded exactly as the daemon loads it, each error
told with its field path and reason; what the models accept but the start would fail
on; and `sandboxd check --config` / `sandboxd --version` through main()."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandboxd import __version__
from sandboxd.check.config import ConfigError, field_path, load_config, render_errors
from sandboxd.main import main

from .fifos import finishes, make_fifo


def config_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sandboxd.yaml"
    path.write_text(text)
    return path


def errors_of(tmp_path: Path, text: str) -> dict[str, str]:
    settings, errors = load_config(config_file(tmp_path, text))
    assert settings is None and errors
    return {e.field: e.reason for e in errors}


class TestFieldPaths:
    def test_an_unknown_key_is_named_with_the_setting_it_may_mean(self, tmp_path):
        got = errors_of(tmp_path, "socket_mod: 0o660\n")
        assert got == {"socket_mod": "unknown key: no such setting (did you mean 'socket_mode'?)"}

    def test_a_malformed_always_blocked_pattern_is_named_by_its_index(self, tmp_path):
        got = errors_of(tmp_path, "always_blocked: ['.env', 'a/**/b']\n")
        assert "'**' only as its first name" in got["always_blocked[1]"]

    def test_an_unknown_nested_key_is_named_with_its_section(self, tmp_path):
        got = errors_of(tmp_path, "limits:\n  max_pidz: 10\n")
        assert got["limits.max_pidz"] == "unknown key: no such setting of limits (did you mean 'max_pids'?)"

    def test_an_unknown_key_in_a_credential_binding(self, tmp_path):
        got = errors_of(tmp_path, "credentials:\n  gh:\n    env: GH\n    principal: [root]\n")
        assert "did you mean 'principals'" in got["credentials.gh.principal"]

    def test_a_wrong_type_names_what_was_given(self, tmp_path):
        got = errors_of(tmp_path, "limits:\n  max_pids: lots\n")
        assert got["limits.max_pids"].startswith("Input should be a valid integer")
        assert got["limits.max_pids"].endswith("(got 'lots')")

    def test_a_list_item_is_named_by_its_index(self, tmp_path):
        got = errors_of(tmp_path, "allowed_images: [sandboxd/*, [nested]]\n")
        assert "allowed_images[1]" in got

    def test_a_mode_in_decimal_is_refused(self, tmp_path):
        got = errors_of(tmp_path, "socket_mode: 660\n")
        assert got == {"socket_mode": "660 is written in decimal (= 0o1224): write a mode in octal, e.g. 0o660"}

    def test_a_mode_in_octal_loads(self, tmp_path):
        settings, errors = load_config(config_file(tmp_path, "socket_mode: 0o640\n"))
        assert errors == [] and settings is not None and settings.socket_mode == 0o640

    def test_a_bad_sha256_is_named_by_its_own_path(self, tmp_path):
        got = errors_of(tmp_path, "nsjail:\n  nsjail_binary_sha256: ABC\n")
        assert got == {"nsjail.nsjail_binary_sha256": "'ABC' is neither 64 lowercase hex digits nor 'unchecked'"}

    def test_a_validator_naming_its_own_field_is_taken_at_its_word(self, tmp_path):
        got = errors_of(tmp_path, f"tcp:\n  address: 127.0.0.1:7443\n  cert_file: {tmp_path}/absent.pem\n"
                                  f"  key_file: {tmp_path}/k\n  client_ca_file: {tmp_path}/ca\n")
        assert got == {"tcp.cert_file": f"{tmp_path}/absent.pem is not a file (TCP needs mutual TLS)"}

    def test_a_missing_required_field(self, tmp_path):
        got = errors_of(tmp_path, "tcp:\n  address: 127.0.0.1:7443\n")
        assert got["tcp.cert_file"] == "required, but missing"

    def test_a_bad_mapping_key(self, tmp_path):
        got = errors_of(tmp_path, "principals:\n  alice: alice\n")
        assert got["principals.alice"].startswith("the key: Input should be a valid integer")

    def test_every_error_is_reported_not_only_the_first(self, tmp_path):
        got = errors_of(tmp_path, "socket_mode: 660\nbogus: 1\nlimits: {max_pids: x}\n")
        assert set(got) == {"socket_mode", "bogus", "limits.max_pids"}

    def test_an_endpoints_password_is_never_echoed(self, tmp_path):
        got = errors_of(tmp_path, "artifacts:\n  endpoint_url: s3://AKIA:hunter2-pw@minio:9000\n")
        assert got == {"artifacts.endpoint_url": "String should match pattern '^https?://' (got 's3://***@minio:9000')"}

    def test_a_credential_bindings_value_is_never_echoed(self, tmp_path):
        got = errors_of(tmp_path, "credentials:\n  gh:\n    command: vault read -token=hunter2-tok\n"
                                  "    principals: [alice]\n")
        assert got == {"credentials.gh.command": "Input should be a valid tuple (got a value not shown: a "
                                                 "credential's)"}

    def test_field_path_spelling(self):
        assert field_path(("limits", "max_pids")) == "limits.max_pids"
        assert field_path(("workspace_roots", 2)) == "workspace_roots[2]"
        assert field_path(()) == ""


class TestTheFile:
    def test_yaml_syntax_errors_name_the_line(self, tmp_path):
        got = errors_of(tmp_path, "state_dir: /x\nsocket_mode: [\n")
        assert list(got) == [""] and "not valid YAML: line 3, column 1" in got[""]

    def test_a_file_that_is_no_mapping(self, tmp_path):
        got = errors_of(tmp_path, "- a\n- b\n")
        assert "must be a mapping" in got[""]

    def test_a_missing_file(self, tmp_path):
        settings, errors = load_config(tmp_path / "absent.yaml")
        assert settings is None and errors == [ConfigError("", f"{tmp_path / 'absent.yaml'}: cannot be read: "
                                                                "does not exist")]

    def test_a_fifo_named_as_the_config_is_refused_without_blocking(self, tmp_path):
        fifo = make_fifo(tmp_path / "sandboxd.yaml", 0o644)
        settings, errors = finishes(fifo, lambda: load_config(fifo))
        assert settings is None and errors == [ConfigError("", f"{fifo}: cannot be read: is a FIFO, not a "
                                                               "regular file")]

    def test_the_config_may_be_a_symlink_to_a_file(self, tmp_path):
        real = config_file(tmp_path, "log_level: debug\n")
        (tmp_path / "link.yaml").symlink_to(real)
        settings, errors = load_config(tmp_path / "link.yaml")
        assert errors == [] and settings is not None and settings.log_level == "debug"

    def test_no_file_is_the_embedded_defaults(self):
        settings, errors = load_config(None)
        assert errors == [] and settings is not None and settings.default_backend == "docker"

    def test_the_rendered_message_has_a_line_per_error(self, tmp_path):
        text = render_errors("/etc/sandboxd.yaml", [ConfigError("socket_mode", "decimal"), ConfigError("bogus", "x")])
        assert text.splitlines() == ["sandboxd: bad configuration (/etc/sandboxd.yaml): 2 errors",
                                     "  socket_mode: decimal", "  bogus: x"]


class TestWhatTheStartWouldFailOn:
    @pytest.mark.parametrize(("text", "field", "words"), [
        ("default_backend: dockr\n", "default_backend", "'dockr' is no backend"),
        ("default_backend: nsjail\nnsjail: {enabled: false}\n", "default_backend", "nsjail is disabled"),
        ("log_level: loud\n", "log_level", "'loud' is no log level"),
        ("socket_owner: no-such-user-here\n", "socket_owner", "no user named 'no-such-user-here'"),
        ("socket_group: no-such-group-here\n", "socket_group", "no group named 'no-such-group-here'"),
        ("metrics_address: nope\n", "metrics_address", "is not host:port"),
    ])
    def test_refused_with_the_field(self, tmp_path, text, field, words):
        got = errors_of(tmp_path, text)
        assert words in got[field]

    def test_good_values_pass(self, tmp_path):
        settings, errors = load_config(config_file(tmp_path, "default_backend: nsjail\nlog_level: debug\n"
                                                             "socket_owner: root\nsocket_group: '0'\n"
                                                             "metrics_address: 127.0.0.1:0\n"))
        assert errors == [] and settings is not None


class TestMain:
    def test_version(self, capsys):
        with pytest.raises(SystemExit) as exc:
            main(["--version"])
        assert exc.value.code == 0 and capsys.readouterr().out == f"sandboxd {__version__}\n" == "sandboxd 0.1.0\n"

    def test_check_with_a_bad_config_exits_2_naming_each_field(self, tmp_path, capsys):
        path = config_file(tmp_path, "socket_mode: 660\nbogus: 1\nnsjail: {nsjail_binary_sha256: abc}\n")
        assert main(["check", "--config", str(path)]) == 2
        out = capsys.readouterr().out
        assert "fail  config  socket_mode: 660 is written in decimal" in out
        assert "fail  config  bogus: unknown key" in out
        assert "fail  config  nsjail.nsjail_binary_sha256: 'abc' is neither" in out

    def test_check_json_with_a_bad_config(self, tmp_path, capsys):
        path = config_file(tmp_path, "limits: {max_pids: many}\n")
        assert main(["--config", str(path), "check", "--json"]) == 2
        got = json.loads(capsys.readouterr().out)
        assert [(f["probe"], f["status"], f["field"]) for f in got] == [("config", "fail", "limits.max_pids")]

    def test_the_start_with_a_bad_config_exits_2_before_anything(self, tmp_path, capsys):
        path = config_file(tmp_path, f"state_dir: {tmp_path}/state\nruntime_dir: {tmp_path}/runtime\n"
                                     f"socket_path: {tmp_path}/run/s.sock\nsocket_mode: 432\n")
        assert main(["--config", str(path)]) == 2
        err = capsys.readouterr().err
        assert "bad configuration" in err and "socket_mode: 432 is written in decimal (= 0o660)" in err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["sandboxd.yaml"]
