"""The credential broker (sandboxd.secrets.broker): which references a call may make, how
values are read from their sources, and how they are laid out on the daemon's tmpfs for
a sandbox. No Docker, no network; the suite runs as root, so ownership can be set."""

from __future__ import annotations

import dataclasses
import os
import stat
import time
import traceback
from pathlib import Path

import grpc
import pytest

import sandboxd.secrets.broker as credentials
from sandboxd.api.errors import status_code
from sandboxd.sandbox.spec import SECRETS_DIR, SecretMount
from sandboxd.secrets.broker import MAX_SECRET_BYTES, CredentialBroker, ResolvedSecret
from sandboxd.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied, SandboxdError
from sandboxd.policy.models import parse_call, resolve_policy
from sandboxd.core.settings import CredentialBinding, LimitSettings

from .conftest import call_dict
from .fifos import finishes, make_fifo

PRINCIPAL = "alice"
TOOL = "unit.tool"
SANDBOX_UID = 1000
SANDBOX_GID = 1001
ENV_OK = {"environment": {"secretEnvAllowed": True}}

@pytest.fixture
def running_as_root():
    # The daemon runs as root and chowns secrets to the sandbox user: so must these
    # tests. CI runs as root; anywhere else a non-root run is a failure to see.
    if os.geteuid() != 0:
        pytest.fail("these tests chown files: run them as root, as the daemon and CI do")


needs_root = pytest.mark.usefixtures("running_as_root")


def make(refs: list[dict], policy: dict | None = None, tool_id: str = TOOL, inheritable: dict | None = None):
    data = call_dict(toolId=tool_id, credentialRefs=refs)
    if policy is not None:
        data["policy"] = policy
    call = parse_call(data)
    return call, resolve_policy(call, LimitSettings(), inheritable or {})


def binding(**kw) -> CredentialBinding:
    kw.setdefault("principals", (PRINCIPAL,))
    return CredentialBinding(**kw)


def secret_file(tmp_path: Path, content: bytes, mode: int = 0o600, name: str = "secret") -> Path:
    path = tmp_path / "src" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(content)
    os.chmod(path, mode)
    return path


_BROKERS: list[CredentialBroker] = []


@pytest.fixture(autouse=True)
def _close_brokers():
    # Each broker holds its secrets dir's descriptor, as the daemon's does for its life.
    yield
    while _BROKERS:
        _BROKERS.pop().close()


def broker(tmp_path: Path, bindings: dict, environment: dict | None = None) -> CredentialBroker:
    b = CredentialBroker(bindings, tmp_path / "secrets", environment={} if environment is None else environment)
    _BROKERS.append(b)
    return b


def after_mkdir(monkeypatch, name: str, action) -> None:
    """Runs action(path) right after a directory named `name` is first made (by path or
    under a descriptor): where an attacker would strike."""
    real_mkdir = os.mkdir
    done = []

    def mkdir(path, *args, **kw):
        real_mkdir(path, *args, **kw)
        if os.path.basename(os.fspath(path)) == name and not done:
            done.append(path)
            action(path)

    monkeypatch.setattr(os, "mkdir", mkdir)


def resolve_one(b: CredentialBroker, ref: dict, policy: dict | None = None, principal: str = PRINCIPAL,
                tool_id: str = TOOL) -> ResolvedSecret:
    call, pol = make([ref], policy, tool_id)
    (out,) = b.resolve(call, pol, principal)
    return out


def refused(kind: type[SandboxdError], fn, *args, **kw) -> SandboxdError:
    with pytest.raises(SandboxdError) as info:
        fn(*args, **kw)
    assert type(info.value) is kind, info.value
    return info.value


def shown(exc: BaseException) -> str:
    """Everything an error shows: message, repr and the formatted traceback."""
    return "\n".join([str(exc), repr(exc), getattr(exc, "reason", ""), "".join(traceback.format_exception(exc))])


# -- ResolvedSecret ---------------------------------------------------------------------------

class TestResolvedSecret:
    VALUE = b"hunter2-very-secret"

    def test_repr_and_str_never_show_the_value(self):
        for s in (ResolvedSecret("gh", self.VALUE, env_name="GH_TOKEN"),
                  ResolvedSecret("gh", self.VALUE, file_path="/tmp/gh")):
            for text in (repr(s), str(s), f"{s}", f"{s!r}", repr((s,)), repr([s]), repr({"k": s})):
                assert "hunter2" not in text
                assert self.VALUE.hex() not in text
            assert "gh" in repr(s)

    def test_repr_names_binding_and_target(self):
        assert repr(ResolvedSecret("gh", self.VALUE, env_name="GH_TOKEN")) == \
            "ResolvedSecret('gh', env='GH_TOKEN', file='')"

    def test_target(self):
        assert ResolvedSecret("gh", self.VALUE, env_name="GH_TOKEN").target == {"env": "GH_TOKEN"}
        assert ResolvedSecret("gh", self.VALUE, file_path="/tmp/gh").target == {"file": "/tmp/gh"}

    def test_value_not_in_a_traceback_that_shows_locals_repr(self):
        s = ResolvedSecret("gh", self.VALUE, env_name="GH_TOKEN")
        try:
            raise RuntimeError(f"failed with {s!r}")
        except RuntimeError as exc:
            assert "hunter2" not in "".join(traceback.format_exception(exc))


# -- file source ----------------------------------------------------------------------------------

class TestFileSource:
    @pytest.mark.parametrize("mode", [0o600, 0o400, 0o700, 0o200])
    def test_owner_only_modes_are_accepted(self, tmp_path, mode):
        path = secret_file(tmp_path, b"s3cret", mode)
        b = broker(tmp_path, {"k": binding(file=path)})
        assert resolve_one(b, {"bindingId": "k", "filePath": "/tmp/k"}).value == b"s3cret"

    @pytest.mark.parametrize("mode", [0o640, 0o644, 0o604, 0o620, 0o602, 0o610, 0o601, 0o660, 0o666, 0o777])
    def test_group_or_other_bits_are_refused(self, tmp_path, mode):
        path = secret_file(tmp_path, b"s3cret-in-file", mode)
        b = broker(tmp_path, {"k": binding(file=path)})
        exc = refused(FailedPrecondition, resolve_one, b, {"bindingId": "k", "filePath": "/tmp/k"})
        assert exc.field == "credentialRefs[0].bindingId"
        assert status_code(exc) == grpc.StatusCode.FAILED_PRECONDITION
        assert "0600" in exc.reason
        assert "s3cret-in-file" not in shown(exc)

    @needs_root
    def test_a_file_owned_by_another_user_is_refused(self, tmp_path):
        path = secret_file(tmp_path, b"s3cret", 0o600)
        os.chown(path, SANDBOX_UID, SANDBOX_GID)
        b = broker(tmp_path, {"k": binding(file=path)})
        exc = refused(FailedPrecondition, resolve_one, b, {"bindingId": "k", "filePath": "/tmp/k"})
        assert exc.field == "credentialRefs[0].bindingId"

    def test_a_missing_file_is_refused(self, tmp_path):
        b = broker(tmp_path, {"k": binding(file=tmp_path / "nope")})
        exc = refused(FailedPrecondition, resolve_one, b, {"bindingId": "k", "filePath": "/tmp/k"})
        assert exc.field == "credentialRefs[0].bindingId"
        assert "does not exist" in exc.reason

    def test_a_symlink_is_not_followed_even_to_a_private_file(self, tmp_path):
        # Checked by name then opened by name, a link let anyone who could place one in a
        # directory on the way swap the file between the two; nothing is followed now.
        real = secret_file(tmp_path, b"s3cret-behind-a-link", name="real")
        link = tmp_path / "src" / "link"
        link.symlink_to(real)
        b = broker(tmp_path, {"k": binding(file=link)})
        exc = refused(FailedPrecondition, resolve_one, b, {"bindingId": "k", "filePath": "/tmp/k"})
        assert exc.field == "credentialRefs[0].bindingId" and "symbolic link" in exc.reason
        assert str(link) not in shown(exc) and "s3cret-behind-a-link" not in shown(exc)

    def test_a_fifo_is_refused_without_blocking(self, tmp_path):
        (tmp_path / "src").mkdir()
        fifo = make_fifo(tmp_path / "src" / "fifo")
        b = broker(tmp_path, {"k": binding(file=fifo)})
        exc = finishes(fifo, lambda: refused(FailedPrecondition, resolve_one, b, {"bindingId": "k",
                                                                                 "filePath": "/tmp/k"}))
        assert "FIFO" in exc.reason and str(fifo) not in shown(exc)

    @pytest.mark.parametrize("content,value", [
        (b"tok\n", b"tok"),
        (b"tok\r\n", b"tok"),
        (b"tok", b"tok"),
        (b"tok\n\n", b"tok\n"),  # only one newline is taken off
        (b"tok\r\n\r\n", b"tok\r\n"),
        (b"tok\r", b"tok\r"),
        (b"\ntok", b"\ntok"),
        (b"-----BEGIN KEY-----\nAAAA\nBBBB\n-----END KEY-----\n", b"-----BEGIN KEY-----\nAAAA\nBBBB\n-----END KEY-----"),
    ])
    def test_a_single_trailing_newline_is_stripped(self, tmp_path, content, value):
        path = secret_file(tmp_path, content)
        b = broker(tmp_path, {"k": binding(file=path)})
        assert resolve_one(b, {"bindingId": "k", "filePath": "/tmp/k"}).value == value

    @pytest.mark.parametrize("content", [b"", b"\n", b"\r\n"])
    def test_an_empty_value_is_refused(self, tmp_path, content):
        path = secret_file(tmp_path, content)
        b = broker(tmp_path, {"k": binding(file=path)})
        exc = refused(FailedPrecondition, resolve_one, b, {"bindingId": "k", "filePath": "/tmp/k"})
        assert exc.field == "credentialRefs[0].bindingId"
        assert "empty" in exc.reason

    def test_size_limit(self, tmp_path):
        assert MAX_SECRET_BYTES == 64 * 1024
        ok = secret_file(tmp_path, b"a" * MAX_SECRET_BYTES, name="ok")
        ok_nl = secret_file(tmp_path, b"b" * MAX_SECRET_BYTES + b"\n", name="ok_nl")
        big = secret_file(tmp_path, b"c" * (MAX_SECRET_BYTES + 1), name="big")
        huge = secret_file(tmp_path, b"d" * (4 * MAX_SECRET_BYTES), name="huge")
        b = broker(tmp_path, {n: binding(file=p) for n, p in
                              (("ok", ok), ("ok_nl", ok_nl), ("big", big), ("huge", huge))})
        assert resolve_one(b, {"bindingId": "ok", "filePath": "/tmp/k"}).value == b"a" * MAX_SECRET_BYTES
        assert resolve_one(b, {"bindingId": "ok_nl", "filePath": "/tmp/k"}).value == b"b" * MAX_SECRET_BYTES
        for name in ("big", "huge"):
            exc = refused(FailedPrecondition, resolve_one, b, {"bindingId": name, "filePath": "/tmp/k"})
            assert exc.field == "credentialRefs[0].bindingId"
            assert str(MAX_SECRET_BYTES) in exc.reason

    @pytest.mark.parametrize("tail", [b"\n" + b"more", b"\n\n", b"\r\nmore"])
    def test_a_larger_file_is_never_truncated_into_a_valid_value(self, tmp_path, tail):
        body = b"e" * (MAX_SECRET_BYTES - (1 if tail.startswith(b"\r\n") else 0))
        path = secret_file(tmp_path, body + tail)
        assert path.stat().st_size > MAX_SECRET_BYTES + 1
        b = broker(tmp_path, {"k": binding(file=path)})
        refused(FailedPrecondition, resolve_one, b, {"bindingId": "k", "filePath": "/tmp/k"})

    def test_a_directory_as_file_source_is_a_failed_precondition(self, tmp_path):
        d = tmp_path / "src-dir"
        d.mkdir(mode=0o700)
        b = broker(tmp_path, {"k": binding(file=d)})
        refused(FailedPrecondition, resolve_one, b, {"bindingId": "k", "filePath": "/tmp/k"})

    def test_binary_value_with_nul_is_kept_for_a_file_target(self, tmp_path):
        value = b"\x00\xffbin\x00ary\x80"
        path = secret_file(tmp_path, value + b"\n")
        b = broker(tmp_path, {"k": binding(file=path)})
        assert resolve_one(b, {"bindingId": "k", "filePath": "/tmp/k"}).value == value

    def test_nul_in_value_is_refused_for_an_env_target(self, tmp_path):
        path = secret_file(tmp_path, b"zq7\x00wx9")
        b = broker(tmp_path, {"k": binding(file=path)})
        exc = refused(FailedPrecondition, resolve_one, b, {"bindingId": "k", "envName": "TOKEN"}, ENV_OK)
        assert exc.field == "credentialRefs[0].envName"
        assert "NUL" in exc.reason
        assert "zq7" not in shown(exc) and "wx9" not in shown(exc)  # nothing of the value


# -- env source -----------------------------------------------------------------------------------

class TestEnvSource:
    def test_read_from_the_mapping_given_not_the_live_environment(self, tmp_path, monkeypatch):
        monkeypatch.setenv("SBX_TEST_TOKEN", "live-value")
        b = broker(tmp_path, {"k": binding(env="SBX_TEST_TOKEN")}, environment={"SBX_TEST_TOKEN": "frozen-value"})
        assert resolve_one(b, {"bindingId": "k", "filePath": "/tmp/k"}).value == b"frozen-value"

    def test_a_variable_only_in_the_live_environment_is_refused(self, tmp_path, monkeypatch):
        monkeypatch.setenv("SBX_TEST_TOKEN", "live-value")
        b = broker(tmp_path, {"k": binding(env="SBX_TEST_TOKEN")}, environment={"OTHER": "x"})
        exc = refused(FailedPrecondition, resolve_one, b, {"bindingId": "k", "filePath": "/tmp/k"})
        assert exc.field == "credentialRefs[0].bindingId"
        assert "SBX_TEST_TOKEN" in exc.reason
        assert "live-value" not in shown(exc)

    def test_default_environment_is_a_snapshot_taken_at_construction(self, tmp_path, monkeypatch):
        monkeypatch.setenv("SBX_TEST_TOKEN", "at-start")
        b = CredentialBroker({"k": binding(env="SBX_TEST_TOKEN"), "late": binding(env="SBX_TEST_LATE")},
                             tmp_path / "secrets")
        monkeypatch.setenv("SBX_TEST_TOKEN", "changed-later")
        monkeypatch.setenv("SBX_TEST_LATE", "set-later")
        assert resolve_one(b, {"bindingId": "k", "filePath": "/tmp/k"}).value == b"at-start"
        refused(FailedPrecondition, resolve_one, b, {"bindingId": "late", "filePath": "/tmp/k"})

    def test_the_given_mapping_is_copied(self, tmp_path):
        env = {"TOKEN": "first"}
        b = broker(tmp_path, {"k": binding(env="TOKEN")}, environment=env)
        env["TOKEN"] = "second"
        assert resolve_one(b, {"bindingId": "k", "filePath": "/tmp/k"}).value == b"first"

    def test_env_value_into_an_env_target(self, tmp_path):
        b = broker(tmp_path, {"k": binding(env="GH")}, environment={"GH": "ghp_abc\n"})
        s = resolve_one(b, {"bindingId": "k", "envName": "GH_TOKEN"}, ENV_OK)
        assert (s.binding_id, s.value, s.env_name, s.file_path) == ("k", b"ghp_abc", "GH_TOKEN", "")

    def test_non_ascii_value_is_utf8(self, tmp_path):
        b = broker(tmp_path, {"k": binding(env="T")}, environment={"T": "pässwörd"})
        assert resolve_one(b, {"bindingId": "k", "filePath": "/tmp/k"}).value == "pässwörd".encode()

    def test_an_empty_variable_is_refused(self, tmp_path):
        b = broker(tmp_path, {"k": binding(env="T")}, environment={"T": ""})
        exc = refused(FailedPrecondition, resolve_one, b, {"bindingId": "k", "filePath": "/tmp/k"})
        assert "empty" in exc.reason

    def test_too_large_variable_is_refused(self, tmp_path):
        b = broker(tmp_path, {"k": binding(env="T")}, environment={"T": "x" * (MAX_SECRET_BYTES + 1)})
        refused(FailedPrecondition, resolve_one, b, {"bindingId": "k", "filePath": "/tmp/k"})

    def test_non_utf8_bytes_of_the_daemon_environment(self, tmp_path):
        raw = b"ab\xffcd"
        b = broker(tmp_path, {"k": binding(env="T")}, environment={"T": os.fsdecode(raw)})
        assert resolve_one(b, {"bindingId": "k", "filePath": "/tmp/k"}).value == raw


# -- command source -------------------------------------------------------------------------------

class TestCommandSource:
    def test_stdout_is_the_value(self, tmp_path):
        b = broker(tmp_path, {"a": binding(command=("printf", "x")),
                              "b": binding(command=("printf", "tok-123\\n")),
                              "c": binding(command=("printf", "a\\000b"))})
        assert resolve_one(b, {"bindingId": "a", "filePath": "/tmp/k"}).value == b"x"
        assert resolve_one(b, {"bindingId": "b", "filePath": "/tmp/k"}).value == b"tok-123"
        assert resolve_one(b, {"bindingId": "c", "filePath": "/tmp/k"}).value == b"a\0b"

    def test_stderr_is_not_part_of_the_value(self, tmp_path):
        b = broker(tmp_path, {"k": binding(command=("sh", "-c", "echo noise >&2; printf val"))})
        assert resolve_one(b, {"bindingId": "k", "filePath": "/tmp/k"}).value == b"val"

    def test_stdin_is_empty_not_the_daemons(self, tmp_path):
        # `cat` would hang on an inherited stdin; with /dev/null it prints nothing.
        b = broker(tmp_path, {"k": binding(command=("cat",))})
        exc = refused(FailedPrecondition, resolve_one, b, {"bindingId": "k", "filePath": "/tmp/k"})
        assert "empty" in exc.reason

    def test_a_failing_command_is_refused_with_its_exit_code(self, tmp_path):
        b = broker(tmp_path, {"k": binding(command=("sh", "-c", "exit 3"))})
        exc = refused(FailedPrecondition, resolve_one, b, {"bindingId": "k", "filePath": "/tmp/k"})
        assert exc.field == "credentialRefs[0].bindingId"
        assert "exited with 3" in exc.reason

    def test_a_failing_command_never_shows_its_output(self, tmp_path):
        script = "printf LEAKED-STDOUT-7731; echo LEAKED-STDERR-9917 >&2; exit 4"
        b = broker(tmp_path, {"k": binding(command=("sh", "-c", script))})
        exc = refused(FailedPrecondition, resolve_one, b, {"bindingId": "k", "filePath": "/tmp/k"})
        assert "exited with 4" in exc.reason
        text = shown(exc)
        assert "LEAKED-STDOUT-7731" not in text
        assert "LEAKED-STDERR-9917" not in text
        assert exc.__cause__ is None

    def test_a_command_that_cannot_start_is_refused(self, tmp_path):
        b = broker(tmp_path, {"k": binding(command=("/nonexistent/sandboxd-secret-helper",))})
        exc = refused(FailedPrecondition, resolve_one, b, {"bindingId": "k", "filePath": "/tmp/k"})
        assert exc.field == "credentialRefs[0].bindingId"
        assert "FileNotFoundError" in exc.reason

    def test_a_command_over_the_size_limit_is_refused(self, tmp_path):
        b = broker(tmp_path, {"k": binding(command=("sh", "-c", f"yes x | head -c {MAX_SECRET_BYTES + 10}"))})
        exc = refused(FailedPrecondition, resolve_one, b, {"bindingId": "k", "filePath": "/tmp/k"})
        assert str(MAX_SECRET_BYTES) in exc.reason
        assert "x\nx\n" not in shown(exc)

    def test_a_command_that_prints_nothing_is_refused(self, tmp_path):
        b = broker(tmp_path, {"k": binding(command=("true",))})
        exc = refused(FailedPrecondition, resolve_one, b, {"bindingId": "k", "filePath": "/tmp/k"})
        assert "empty" in exc.reason

    def test_a_command_that_runs_too_long_is_stopped(self, tmp_path, monkeypatch):
        monkeypatch.setattr(credentials, "COMMAND_TIMEOUT_S", 0.3)
        b = broker(tmp_path, {"k": binding(command=("sh", "-c", "printf LEAKED-PARTIAL-5521; exec sleep 30"))})
        start = time.monotonic()
        exc = refused(FailedPrecondition, resolve_one, b, {"bindingId": "k", "filePath": "/tmp/k"})
        assert time.monotonic() - start < 5
        assert "TimeoutExpired" in exc.reason
        assert exc.field == "credentialRefs[0].bindingId"
        assert "LEAKED-PARTIAL-5521" not in shown(exc)

    def test_a_timed_out_command_leaves_its_output_nowhere_in_the_error(self, tmp_path, monkeypatch):
        monkeypatch.setattr(credentials, "COMMAND_TIMEOUT_S", 0.3)
        b = broker(tmp_path, {"k": binding(command=("sh", "-c", "printf LEAKED-PARTIAL-5521; exec sleep 30"))})
        exc = refused(FailedPrecondition, resolve_one, b, {"bindingId": "k", "filePath": "/tmp/k"})
        chain = []
        e: BaseException | None = exc
        while e is not None:
            chain.append(e)
            e = e.__cause__ or e.__context__
        for e in chain:
            for attr in ("stdout", "stderr", "output"):
                assert b"LEAKED-PARTIAL" not in (getattr(e, attr, None) or b"")


# -- who may use a binding (no oracle) --------------------------------------------------------------

class TestPermission:
    def _three_refusals(self, tmp_path):
        path = secret_file(tmp_path, b"s3cret")
        cases = {
            "unknown": broker(tmp_path, {"other": binding(file=path)}),
            "principal": broker(tmp_path, {"gh": binding(file=path, principals=("bob", "carol"))}),
            "tool": broker(tmp_path, {"gh": binding(file=path, tools=("deploy.*", "unit.other"))}),
        }
        out = {}
        for name, b in cases.items():
            call, pol = make([{"bindingId": "gh", "envName": "GH"}], ENV_OK)
            out[name] = refused(PermissionDenied, b.resolve, call, pol, PRINCIPAL)
        return out

    def test_unknown_binding_principal_and_tool_refusals_read_the_same(self, tmp_path):
        out = self._three_refusals(tmp_path)
        messages = {e.message for e in out.values()}
        assert len(messages) == 1, messages
        for e in out.values():
            assert e.field == "credentialRefs[0].bindingId"
            assert status_code(e) == grpc.StatusCode.PERMISSION_DENIED
            assert e.reason == f"credential 'gh' is not available to {PRINCIPAL} for tool '{TOOL}'"

    def test_a_refused_binding_is_never_read(self, tmp_path):
        marker = tmp_path / "ran"
        b = broker(tmp_path, {"gh": binding(command=("sh", "-c", f"touch {marker}; printf x"),
                                            principals=("bob",))})
        call, pol = make([{"bindingId": "gh", "filePath": "/tmp/gh"}])
        refused(PermissionDenied, b.resolve, call, pol, PRINCIPAL)
        assert not marker.exists()
        # ... while an allowed principal does run it.
        b.resolve(call, pol, "bob")
        assert marker.exists()

    def test_permission_is_checked_before_the_target(self, tmp_path):
        # A bad target of an unusable binding still reads as "not available".
        b = broker(tmp_path, {})
        for ref in ({"bindingId": "gh", "envName": "1BAD"}, {"bindingId": "gh", "filePath": "relative"},
                    {"bindingId": "gh"}, {"bindingId": "gh", "envName": "E", "filePath": "/tmp/x"}):
            call, pol = make([ref])
            e = refused(PermissionDenied, b.resolve, call, pol, PRINCIPAL)
            assert e.field == "credentialRefs[0].bindingId"

    def test_nobody_may_use_a_binding_without_principals(self, tmp_path):
        b = broker(tmp_path, {"k": CredentialBinding(command=("printf", "x"))})
        for p in (PRINCIPAL, "root", ""):
            call, pol = make([{"bindingId": "k", "filePath": "/tmp/k"}])
            refused(PermissionDenied, b.resolve, call, pol, p)

    def test_tool_patterns(self, tmp_path):
        b = broker(tmp_path, {"k": binding(command=("printf", "x"), tools=("unit.*", "deploy.prod"))})
        for tool in ("unit.tool", "unit.x.y", "deploy.prod"):
            resolve_one(b, {"bindingId": "k", "filePath": "/tmp/k"}, tool_id=tool)
        for tool in ("UNIT.tool", "deploy.prod2", "deploy.staging", "xunit.tool"):
            call, pol = make([{"bindingId": "k", "filePath": "/tmp/k"}], tool_id=tool)
            refused(PermissionDenied, b.resolve, call, pol, PRINCIPAL)

    def test_default_tools_is_every_tool(self, tmp_path):
        b = broker(tmp_path, {"k": binding(command=("printf", "x"))})
        assert resolve_one(b, {"bindingId": "k", "filePath": "/tmp/k"}, tool_id="anything.at-all").value == b"x"

    def test_principal_is_matched_exactly(self, tmp_path):
        b = broker(tmp_path, {"k": binding(command=("printf", "x"), principals=("alice",))})
        for p in ("Alice", "alic", "alice2", "*"):
            call, pol = make([{"bindingId": "k", "filePath": "/tmp/k"}])
            refused(PermissionDenied, b.resolve, call, pol, p)


# -- targets --------------------------------------------------------------------------------------

@pytest.fixture
def cmd_broker(tmp_path):
    return broker(tmp_path, {"k": binding(command=("printf", "v1")), "k2": binding(command=("printf", "v2"))})


class TestTargets:
    @pytest.mark.parametrize("ref", [{"bindingId": "k"}, {"bindingId": "k", "envName": "E", "filePath": "/tmp/e"}])
    def test_exactly_one_of_env_name_and_file_path(self, cmd_broker, ref):
        call, pol = make([ref], ENV_OK)
        e = refused(InvalidArgument, cmd_broker.resolve, call, pol, PRINCIPAL)
        assert e.field == "credentialRefs[0]"
        assert "exactly one" in e.reason

    @pytest.mark.parametrize("name", ["1TOKEN", "TO-KEN", "TO KEN", "A=B", "TOKÉN", "TOKEN\n", "$X", "a.b"])
    def test_invalid_env_names(self, cmd_broker, name):
        call, pol = make([{"bindingId": "k", "envName": name}], ENV_OK)
        e = refused(InvalidArgument, cmd_broker.resolve, call, pol, PRINCIPAL)
        assert e.field == "credentialRefs[0].envName"

    @pytest.mark.parametrize("name", ["_X", "token_2", "GH_TOKEN", "a"])
    def test_valid_env_names(self, cmd_broker, name):
        assert resolve_one(cmd_broker, {"bindingId": "k", "envName": name}, ENV_OK).env_name == name

    def test_env_target_needs_secret_env_allowed(self, cmd_broker):
        for policy in (None, {"environment": {"secretEnvAllowed": False}}):
            call, pol = make([{"bindingId": "k", "envName": "TOKEN"}], policy)
            e = refused(PermissionDenied, cmd_broker.resolve, call, pol, PRINCIPAL)
            assert e.field == "credentialRefs[0].envName"
            assert "secretEnvAllowed" in e.reason
        # A file target does not need it.
        assert resolve_one(cmd_broker, {"bindingId": "k", "filePath": "/tmp/k"}).value == b"v1"

    @pytest.mark.parametrize("name", ["PATH", "HOME", "TMPDIR", "LANG", "FOO", "TZ"])
    def test_env_name_set_by_the_policy_is_refused(self, cmd_broker, name):
        policy = {"environment": {"secretEnvAllowed": True, "injectedEnv": {"FOO": "1"}, "inheritedEnv": ["TZ"]}}
        data = call_dict(toolId=TOOL, credentialRefs=[{"bindingId": "k", "envName": name}], policy=policy)
        call = parse_call(data)
        pol = resolve_policy(call, LimitSettings(), {"TZ": "UTC"})
        e = refused(InvalidArgument, cmd_broker.resolve, call, pol, PRINCIPAL)
        assert e.field == "credentialRefs[0].envName"

    @pytest.mark.parametrize("path,stored", [
        ("/tmp/k", "/tmp/k"),
        ("/tmp/a/b/key.pem", "/tmp/a/b/key.pem"),
        ("/tmp/k/", "/tmp/k"),
        ("/tmp/.k", "/tmp/.k"),
    ])
    def test_file_targets_inside_temp_dir(self, cmd_broker, path, stored):
        s = resolve_one(cmd_broker, {"bindingId": "k", "filePath": path})
        assert s.file_path == stored
        assert s.env_name == ""
        assert s.target == {"file": stored}

    @pytest.mark.parametrize("path", [
        "tmp/k", "k", "./k", "/tmp", "/tmp/", "/", "/tmp/../etc/passwd", "/tmp/./k", "/tmp//k", "//tmp/k",
        "/tmp/a/../k", "/tmpx/k", "/tmp-k", "/workspace/k", "/etc/k", "/dev/sandboxd/secrets/0", "/tmp/..",
    ])
    def test_file_targets_outside_temp_dir_or_unnormalized_are_refused(self, cmd_broker, path):
        call, pol = make([{"bindingId": "k", "filePath": path}])
        e = refused(InvalidArgument, cmd_broker.resolve, call, pol, PRINCIPAL)
        assert e.field == "credentialRefs[0].filePath"

    def test_file_target_follows_a_custom_temp_dir(self, cmd_broker):
        policy = {"filesystem": {"readRoots": ["/workspace"], "tempDir": "/scratch"}}
        assert resolve_one(cmd_broker, {"bindingId": "k", "filePath": "/scratch/key"}, policy).file_path == "/scratch/key"
        call, pol = make([{"bindingId": "k", "filePath": "/tmp/key"}], policy)
        e = refused(InvalidArgument, cmd_broker.resolve, call, pol, PRINCIPAL)
        assert e.field == "credentialRefs[0].filePath"
        assert "/scratch" in e.reason

    def test_file_target_in_a_blocked_path_is_refused(self, cmd_broker):
        # resolve_policy keeps blocked paths inside /workspace and tempDir outside it, so
        # the broker's own check is exercised with a hand-made policy.
        call, pol = make([{"bindingId": "k", "filePath": "/tmp/blocked/key"}])
        pol = dataclasses.replace(pol, blocked_paths=("/tmp/blocked",))
        e = refused(InvalidArgument, cmd_broker.resolve, call, pol, PRINCIPAL)
        assert e.field == "credentialRefs[0].filePath"
        assert "blocked" in e.reason
        call, _ = make([{"bindingId": "k", "filePath": "/tmp/blocked"}])
        e = refused(InvalidArgument, cmd_broker.resolve, call, pol, PRINCIPAL)
        assert e.field == "credentialRefs[0].filePath"
        call, _ = make([{"bindingId": "k", "filePath": "/tmp/blockedx"}])
        assert cmd_broker.resolve(call, pol, PRINCIPAL)[0].file_path == "/tmp/blockedx"

    @pytest.mark.parametrize("refs", [
        [{"bindingId": "k", "envName": "T"}, {"bindingId": "k2", "envName": "T"}],
        [{"bindingId": "k", "filePath": "/tmp/t"}, {"bindingId": "k2", "filePath": "/tmp/t"}],
        [{"bindingId": "k", "filePath": "/tmp/t"}, {"bindingId": "k", "filePath": "/tmp/t/"}],
    ])
    def test_duplicate_targets_are_refused(self, cmd_broker, refs):
        call, pol = make(refs, ENV_OK)
        e = refused(InvalidArgument, cmd_broker.resolve, call, pol, PRINCIPAL)
        assert e.field == "credentialRefs[1]"
        assert "same target" in e.reason

    def test_same_binding_to_several_targets(self, cmd_broker):
        call, pol = make([{"bindingId": "k", "envName": "T"}, {"bindingId": "k", "filePath": "/tmp/T"},
                          {"bindingId": "k", "envName": "U"}], ENV_OK)
        out = cmd_broker.resolve(call, pol, PRINCIPAL)
        assert [(s.binding_id, s.value, s.target) for s in out] == [
            ("k", b"v1", {"env": "T"}), ("k", b"v1", {"file": "/tmp/T"}), ("k", b"v1", {"env": "U"})]

    def test_no_refs_resolve_to_nothing(self, cmd_broker):
        call, pol = make([])
        assert cmd_broker.resolve(call, pol, PRINCIPAL) == ()

    def test_resolve_keeps_the_order_of_the_refs(self, cmd_broker):
        call, pol = make([{"bindingId": "k2", "filePath": "/tmp/b"}, {"bindingId": "k", "envName": "A"}], ENV_OK)
        out = cmd_broker.resolve(call, pol, PRINCIPAL)
        assert isinstance(out, tuple)
        assert [(s.binding_id, s.value, s.env_name, s.file_path) for s in out] == [
            ("k2", b"v2", "", "/tmp/b"), ("k", b"v1", "A", "")]


class TestFieldIndex:
    """A refusal of the second reference names credentialRefs[1]."""

    FIRST = {"bindingId": "k", "filePath": "/tmp/first"}

    def _second(self, b, ref, policy=ENV_OK):
        call, pol = make([self.FIRST, ref], policy)
        with pytest.raises(SandboxdError) as info:
            b.resolve(call, pol, PRINCIPAL)
        return info.value

    def test_every_kind_of_refusal(self, tmp_path):
        b = broker(tmp_path, {
            "k": binding(command=("printf", "v1")),
            "nul": binding(command=("printf", "a\\000b")),
            "fails": binding(command=("false",)),
            "bob": binding(command=("printf", "x"), principals=("bob",)),
        })
        cases = [
            ({"bindingId": "nope", "envName": "A"}, ENV_OK, PermissionDenied, "credentialRefs[1].bindingId"),
            ({"bindingId": "bob", "envName": "A"}, ENV_OK, PermissionDenied, "credentialRefs[1].bindingId"),
            ({"bindingId": "k"}, ENV_OK, InvalidArgument, "credentialRefs[1]"),
            ({"bindingId": "k", "envName": "A-B"}, ENV_OK, InvalidArgument, "credentialRefs[1].envName"),
            ({"bindingId": "k", "envName": "A"}, None, PermissionDenied, "credentialRefs[1].envName"),
            ({"bindingId": "k", "envName": "PATH"}, ENV_OK, InvalidArgument, "credentialRefs[1].envName"),
            ({"bindingId": "k", "filePath": "/etc/x"}, ENV_OK, InvalidArgument, "credentialRefs[1].filePath"),
            ({"bindingId": "k", "filePath": "/tmp/first"}, ENV_OK, InvalidArgument, "credentialRefs[1]"),
            ({"bindingId": "fails", "filePath": "/tmp/x"}, ENV_OK, FailedPrecondition, "credentialRefs[1].bindingId"),
            ({"bindingId": "nul", "envName": "A"}, ENV_OK, FailedPrecondition, "credentialRefs[1].envName"),
        ]
        for ref, policy, kind, field in cases:
            e = self._second(b, ref, policy)
            assert type(e) is kind, (ref, e)
            assert e.field == field, (ref, e)
            assert e.message.startswith(field + ": ")


# -- the sandbox's files ----------------------------------------------------------------------------

SECRETS = (
    ResolvedSecret("gh", b"ghp_token-value", env_name="GH_TOKEN"),
    ResolvedSecret("key", b"-----BEGIN KEY-----\nAAA\n-----END KEY-----", file_path="/tmp/key.pem"),
    ResolvedSecret("bin", b"\x00\xff\x00bin", file_path="/tmp/sub/bin"),
    ResolvedSecret("gh", b"ghp_token-value", env_name="OTHER"),
)


class TestMounts:
    def test_layout(self, tmp_path):
        b = broker(tmp_path, {})
        base = tmp_path / "secrets" / "sbx-1"
        assert b.sandbox_dir("sbx-1") == base
        assert b.mounts("sbx-1", SECRETS) == (
            SecretMount("gh", str(base / "0"), f"{SECRETS_DIR}/0", "GH_TOKEN"),
            SecretMount("key", str(base / "1"), "/tmp/key.pem", ""),
            SecretMount("bin", str(base / "2"), "/tmp/sub/bin", ""),
            SecretMount("gh", str(base / "3"), f"{SECRETS_DIR}/3", "OTHER"),
        )
        assert SECRETS_DIR == "/dev/sandboxd/secrets"

    def test_mounts_are_pure(self, tmp_path):
        b = broker(tmp_path, {})
        b.mounts("sbx-1", SECRETS)
        assert list((tmp_path / "secrets").iterdir()) == []

    def test_no_value_in_a_mount(self, tmp_path):
        for m in broker(tmp_path, {}).mounts("sbx-1", SECRETS):
            text = repr(m) + str(dataclasses.asdict(m))
            assert "ghp_token" not in text and "BEGIN KEY" not in text

    def test_empty(self, tmp_path):
        assert broker(tmp_path, {}).mounts("sbx-1", ()) == ()


@needs_root
class TestMaterialize:
    def test_files_hold_exactly_the_values_readable_by_the_sandbox_user_only(self, tmp_path):
        b = broker(tmp_path, {})
        b.materialize("sbx-1", SECRETS, SANDBOX_UID, SANDBOX_GID)
        root = tmp_path / "secrets"
        base = root / "sbx-1"
        assert stat.S_IMODE(root.stat().st_mode) == 0o711
        assert stat.S_IMODE(base.stat().st_mode) == 0o711
        assert sorted(p.name for p in base.iterdir()) == ["0", "1", "2", "3"]
        for m, s in zip(b.mounts("sbx-1", SECRETS), SECRETS):
            st = os.lstat(m.host_path)
            assert stat.S_ISREG(st.st_mode)
            assert stat.S_IMODE(st.st_mode) == 0o400
            assert (st.st_uid, st.st_gid) == (SANDBOX_UID, SANDBOX_GID)
            assert Path(m.host_path).read_bytes() == s.value

    def test_an_existing_secrets_dir_is_made_traversable_only(self, tmp_path):
        root = tmp_path / "secrets"
        root.mkdir(mode=0o700)
        os.chmod(root, 0o755)
        broker(tmp_path, {}).materialize("sbx-1", SECRETS[:1], SANDBOX_UID, SANDBOX_GID)
        assert stat.S_IMODE(root.stat().st_mode) == 0o711

    def test_modes_do_not_depend_on_the_umask(self, tmp_path):
        old = os.umask(0o077)
        try:
            broker(tmp_path, {}).materialize("sbx-1", SECRETS[:1], SANDBOX_UID, SANDBOX_GID)
        finally:
            os.umask(old)
        assert stat.S_IMODE((tmp_path / "secrets").stat().st_mode) == 0o711
        assert stat.S_IMODE((tmp_path / "secrets" / "sbx-1" / "0").stat().st_mode) == 0o400
        assert stat.S_IMODE((tmp_path / "secrets" / "sbx-1").stat().st_mode) == 0o711

    def test_a_second_materialize_of_the_same_sandbox_is_refused(self, tmp_path):
        b = broker(tmp_path, {})
        b.materialize("sbx-1", SECRETS[:1], SANDBOX_UID, SANDBOX_GID)
        with pytest.raises(OSError):
            b.materialize("sbx-1", (ResolvedSecret("x", b"other", file_path="/tmp/x"),), SANDBOX_UID, SANDBOX_GID)
        assert (tmp_path / "secrets" / "sbx-1" / "0").read_bytes() == SECRETS[0].value

    def test_a_symlink_at_the_sandbox_dir_is_not_followed(self, tmp_path):
        victim = tmp_path / "victim"
        victim.mkdir()
        (tmp_path / "secrets").mkdir()
        (tmp_path / "secrets" / "sbx-1").symlink_to(victim)
        with pytest.raises(OSError):
            broker(tmp_path, {}).materialize("sbx-1", SECRETS, SANDBOX_UID, SANDBOX_GID)
        assert list(victim.iterdir()) == []

    @pytest.mark.parametrize("dangling", [False, True])
    def test_a_symlink_at_a_secret_file_is_not_followed(self, tmp_path, monkeypatch, dangling):
        victim = tmp_path / "victim.txt"
        if not dangling:
            victim.write_bytes(b"original")
        base = tmp_path / "secrets" / "sbx-1"
        b = broker(tmp_path, {})

        def plant(_path):
            # Someone plants a symlink at the first secret's path right after the
            # sandbox's directory appears.
            (base / "0").symlink_to(victim)

        after_mkdir(monkeypatch, "sbx-1", plant)
        with pytest.raises(OSError):
            b.materialize("sbx-1", SECRETS, SANDBOX_UID, SANDBOX_GID)
        if dangling:
            assert not victim.exists()
        else:
            assert victim.read_bytes() == b"original"
            st = victim.stat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) != (SANDBOX_UID, 0o400)
        assert not os.path.lexists(base)  # the failed sandbox's directory is gone

    def test_release_removes_the_sandbox_dir_only(self, tmp_path):
        b = broker(tmp_path, {})
        b.materialize("sbx-1", SECRETS, SANDBOX_UID, SANDBOX_GID)
        b.materialize("sbx-2", SECRETS[:2], SANDBOX_UID, SANDBOX_GID)
        b.release("sbx-1")
        assert not (tmp_path / "secrets" / "sbx-1").exists()
        assert (tmp_path / "secrets" / "sbx-2" / "1").read_bytes() == SECRETS[1].value
        b.release("sbx-1")  # twice: harmless
        b.release("never-existed")
        b.release("sbx-2")
        assert list((tmp_path / "secrets").iterdir()) == []
        assert (tmp_path / "secrets").is_dir()

    def test_purge_removes_what_a_crashed_run_left(self, tmp_path):
        b = broker(tmp_path, {})
        b.materialize("sbx-1", SECRETS, SANDBOX_UID, SANDBOX_GID)
        b.materialize("sbx-2", SECRETS[:1], SANDBOX_UID, SANDBOX_GID)
        stale = tmp_path / "secrets" / "sbx-old" / "nested"
        stale.mkdir(parents=True)
        (stale / "f").write_bytes(b"x")
        os.chmod(stale / "f", 0o400)
        # A fresh broker on the same dir, as at start-up.
        broker(tmp_path, {}).purge()
        assert (tmp_path / "secrets").is_dir()
        assert list((tmp_path / "secrets").iterdir()) == []

    def test_purge_never_follows_a_symlink_out(self, tmp_path):
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "keep.txt").write_bytes(b"keep")
        root = tmp_path / "secrets"
        root.mkdir()
        (root / "link").symlink_to(outside)
        broker(tmp_path, {}).purge()
        assert (outside / "keep.txt").read_bytes() == b"keep"

    def test_purge_of_a_fresh_secrets_dir(self, tmp_path):
        broker(tmp_path, {}).purge()
        assert list((tmp_path / "secrets").iterdir()) == []


# -- end to end: resolve, lay out, write ------------------------------------------------------------

@needs_root
def test_resolve_then_materialize(tmp_path):
    path = secret_file(tmp_path, b"file-secret\n")
    b = broker(tmp_path, {"f": binding(file=path), "e": binding(env="TOK"), "c": binding(command=("printf", "cmd"))},
               environment={"TOK": "env-secret"})
    call, pol = make([{"bindingId": "f", "filePath": "/tmp/creds/f"}, {"bindingId": "e", "envName": "TOK"},
                      {"bindingId": "c", "envName": "CMD"}], ENV_OK)
    secrets = b.resolve(call, pol, PRINCIPAL)
    mounts = b.mounts("sbx-9", secrets)
    b.materialize("sbx-9", secrets, SANDBOX_UID, SANDBOX_GID)
    assert [(m.sandbox_path, m.env_name, Path(m.host_path).read_bytes()) for m in mounts] == [
        ("/tmp/creds/f", "", b"file-secret"),
        (f"{SECRETS_DIR}/1", "TOK", b"env-secret"),
        (f"{SECRETS_DIR}/2", "CMD", b"cmd"),
    ]
    b.release("sbx-9")
    assert not b.sandbox_dir("sbx-9").exists()
