"""Files a setting names, read as the daemon reads them (core/safe_open.py): opened once,
never through a symlink at their name nor blocking on a FIFO, checked on the descriptor
(a regular file; a secret's the daemon's own, closed to others), read from it. And what
is told when one is wrong: the S3 credentials file by line number only, an endpoint's
user:password@ masked wherever it is printed. As root, as the daemon and CI run."""

from __future__ import annotations

import logging
import os
import socket
import traceback
from pathlib import Path

import pytest

from sandboxd.backends.docker.backend import load_seccomp_profile
from sandboxd.core.artifact_settings import ArtifactSettings, mask_userinfo, without_userinfo
from sandboxd.core.errors import BackendUnavailable, FailedPrecondition
from sandboxd.api.transport import RelayPump
from sandboxd.backends.nsjail.host import is_static_elf, verified_nsjail
from sandboxd.core.safe_open import UnsafeFile, held_setting_file, load_library, open_setting_file, read_setting_file
from sandboxd.core.settings import DaemonSettings
from sandboxd.recording import fanotify_reader
from sandboxd.recording.errors import FileWatchError
from sandboxd.ledger.blobs import BlobStoreUnavailable
from sandboxd.ledger.s3_blobs import read_credentials_file, s3_store

from .fifos import finishes, make_fifo

SECRET_KEY = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYzEXAMPLEKEY"
PASSWORD = "hunter2-s3-pw"
BOB = 1001


@pytest.fixture(autouse=True)
def running_as_root():
    if os.geteuid() != 0:
        pytest.fail("these tests chown to another uid: run them as root, as the daemon and CI do")


def private_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def told(exc: BaseException) -> str:
    """Everything an operator could see of an exception: its text and its whole traceback."""
    return "".join(traceback.format_exception(exc))


class TestOpenSettingFile:
    def test_a_private_regular_file_is_read_through_one_descriptor(self, tmp_path):
        path = private_file(tmp_path / "k", "value\n")
        assert read_setting_file(path, setting="x", max_bytes=64, private=True) == b"value\n"

    @pytest.mark.parametrize("kind", ["fifo", "symlink", "directory", "device", "socket", "missing"])
    def test_anything_but_a_regular_file_at_the_name_is_refused_at_once(self, tmp_path, kind):
        path = tmp_path / "f"
        if kind == "fifo":
            make_fifo(path)
        elif kind == "symlink":
            path.symlink_to(private_file(tmp_path / "target", "value\n"))
        elif kind == "directory":
            path.mkdir(mode=0o700)
        elif kind == "device":
            os.mknod(path, 0o600 | 0o020000, os.makedev(1, 3))  # /dev/null's
        elif kind == "socket":
            with socket.socket(socket.AF_UNIX) as s:
                s.bind(str(path))
        with pytest.raises(UnsafeFile) as exc:
            finishes(path, lambda: read_setting_file(path, setting="some.file", max_bytes=64, private=True))
        assert exc.value.field == "some.file" and str(path) in exc.value.reason
        expected = {"fifo": "is a FIFO", "symlink": "symbolic link", "directory": "is a directory",
                    "device": "character device", "socket": "not a regular file", "missing": "does not exist"}
        assert expected[kind] in exc.value.problem and str(path) not in exc.value.problem

    @pytest.mark.parametrize("mode", [0o640, 0o604, 0o610, 0o601, 0o660])
    def test_a_secret_open_to_group_or_others_is_refused(self, tmp_path, mode):
        path = private_file(tmp_path / "k", "value\n", mode)
        with pytest.raises(UnsafeFile, match="0600 or stricter"):
            open_setting_file(path, setting="x", private=True)
        fd, _st = open_setting_file(path, setting="x")  # not a secret: any mode
        os.close(fd)

    def test_a_secret_of_another_user_is_refused(self, tmp_path):
        path = private_file(tmp_path / "k", "value\n")
        os.chown(path, BOB, BOB)
        with pytest.raises(UnsafeFile, match=f"it is uid {BOB}"):
            open_setting_file(path, setting="x", private=True)

    def test_a_file_past_its_cap_is_refused(self, tmp_path):
        path = private_file(tmp_path / "k", "x" * 65)
        with pytest.raises(UnsafeFile, match="larger than 64 bytes"):
            read_setting_file(path, setting="x", max_bytes=64)
        assert read_setting_file(path, setting="x", max_bytes=65) == b"x" * 65


class TestS3CredentialsFile:
    @pytest.mark.parametrize(("text", "line"), [
        (f"aws_secret_access_key = {SECRET_KEY}\n", 1),  # no [default] header
        (f"[default]\naws_access_key_id = AK\n{SECRET_KEY}\n", 3),  # no key = value
        (f"[default]\naws_secret_access_key = a\naws_secret_access_key = {SECRET_KEY}\n", 3),  # twice
    ])
    def test_a_malformed_file_is_told_by_line_number_never_its_content(self, tmp_path, text, line):
        path = private_file(tmp_path / "credentials", text)
        with pytest.raises(FailedPrecondition) as exc:
            read_credentials_file(path)
        assert exc.value.field == "artifacts.credentials_file"
        assert f"{path}: line {line} is not AWS credentials file syntax" in exc.value.reason
        assert SECRET_KEY not in told(exc.value)

    def test_a_file_that_is_no_utf8_is_told_by_line_number(self, tmp_path):
        path = tmp_path / "credentials"
        path.write_bytes(b"[default]\naws_secret_access_key = \xff" + SECRET_KEY.encode() + b"\n")
        path.chmod(0o600)
        with pytest.raises(FailedPrecondition, match="line 2 is not UTF-8") as exc:
            read_credentials_file(path)
        assert SECRET_KEY not in told(exc.value)

    def test_a_percent_sign_in_a_secret_is_the_secrets(self, tmp_path):
        # ConfigParser's default interpolation refused it, quoting the secret from "%" on.
        path = private_file(tmp_path / "credentials", "[default]\naws_access_key_id = AK\n"
                                                       "aws_secret_access_key = ab%cd%%ef\n")
        assert read_credentials_file(path)["aws_secret_access_key"] == "ab%cd%%ef"

    def test_a_fifo_is_refused_without_blocking(self, tmp_path):
        path = make_fifo(tmp_path / "credentials")
        with pytest.raises(FailedPrecondition, match="is a FIFO"):
            finishes(path, lambda: read_credentials_file(path))

    def test_a_symlink_is_not_followed(self, tmp_path):
        target = private_file(tmp_path / "real", "[default]\naws_access_key_id = AK\naws_secret_access_key = SK\n")
        link = tmp_path / "credentials"
        link.symlink_to(target)
        with pytest.raises(FailedPrecondition, match="symbolic link"):
            read_credentials_file(link)


class TestEndpointUserinfo:
    @pytest.mark.parametrize(("text", "masked"), [
        ("http://user:pw@127.0.0.1:8333", "http://***@127.0.0.1:8333"),
        ("at https://u:p@ss@h/x and http://h2/y", "at https://***@h/x and http://h2/y"),
        ("HTTP://only-user@h", "HTTP://***@h"),
        ("http://h/path@not-userinfo", "http://h/path@not-userinfo"),
        ("no url: user@host", "no url: user@host"),
    ])
    def test_mask(self, text, masked):
        assert mask_userinfo(text) == masked

    def test_boto3_is_given_the_endpoint_without_it(self):
        assert without_userinfo("http://user:pw@[::1]:8333/base") == "http://[::1]:8333/base"
        assert without_userinfo("https://h:1") == "https://h:1"

    def test_the_stores_errors_and_log_never_show_it(self, caplog):
        with socket.socket() as s:  # a loopback port nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        settings = ArtifactSettings(store="s3", endpoint_url=f"http://user:{PASSWORD}@127.0.0.1:{port}")
        with caplog.at_level(logging.DEBUG):
            store = s3_store(settings)  # does not answer: the start goes on, with a warning
            try:
                with pytest.raises(BlobStoreUnavailable) as exc:
                    store.check_bucket()
            finally:
                store.close()
        assert f"http://***@127.0.0.1:{port}" in exc.value.reason
        assert PASSWORD not in told(exc.value)
        assert caplog.records and PASSWORD not in caplog.text


class TestSeccompProfile:
    def test_a_fifo_refuses_the_backend_without_blocking(self, tmp_path):
        path = make_fifo(tmp_path / "profile.json", 0o644)
        with pytest.raises(BackendUnavailable, match="is a FIFO"):
            finishes(path, lambda: load_seccomp_profile(str(path)))

    def test_a_symlink_is_not_followed(self, tmp_path):
        target = private_file(tmp_path / "real.json", '{"defaultAction": "SCMP_ACT_ERRNO"}', 0o644)
        link = tmp_path / "profile.json"
        link.symlink_to(target)
        with pytest.raises(BackendUnavailable, match="symbolic link"):
            load_seccomp_profile(str(link))
        assert load_seccomp_profile(str(target)) == target.read_text()


def test_the_native_helpers_named_by_settings_never_block_the_start_on_a_fifo(tmp_path):
    """The relay and the fanotify reader are dlopened, the nsjail binary hashed, the init
    and the shim read for their ELF header, the shim copied: each through one held
    non-blocking descriptor, so a FIFO in its place is refused at once."""
    fifo = make_fifo(tmp_path / "helper")
    with pytest.raises(FailedPrecondition, match="relay"):
        finishes(fifo, lambda: RelayPump(fifo))
    assert finishes(fifo, lambda: is_static_elf(str(fifo))) is False
    with pytest.raises(BackendUnavailable, match="not a regular file"):
        finishes(fifo, lambda: verified_nsjail(str(fifo), "unchecked"))
    fanotify_reader.use_reader_library(fifo)
    try:
        with pytest.raises(FileWatchError, match="cannot be loaded"):
            finishes(fifo, fanotify_reader.reader_library)
    finally:
        fanotify_reader.use_reader_library(None)
    with pytest.raises(UnsafeFile, match="not a regular file"):  # a directory is no file either
        with held_setting_file(tmp_path):
            pass


def test_two_libraries_loaded_through_descriptors_are_never_taken_for_each_other():
    """dlopen knows a loaded object by the name it was given: were the first library's
    /proc/self/fd/N closed and N reused for the second, the second load would return the
    first. Each descriptor stays open, so each name stays its own."""
    settings = DaemonSettings()
    relay = load_library(settings.relay_library, setting="relay_library")
    reader = load_library(settings.file_audit.reader_library, setting="file_audit.reader_library")
    assert hasattr(relay, "relay_start") and not hasattr(relay, "fw_new")
    assert hasattr(reader, "fw_new") and not hasattr(reader, "relay_start")
