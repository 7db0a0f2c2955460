"""`sandboxd check`'s artifact-store probe where no S3 server is needed: the local store,
and an S3 configuration refused before any request (its credentials file). Reaching a
real bucket, a missing one and a silent store: tests/integration/test_s3_artifacts.py."""

from __future__ import annotations

from sandboxd.check.artifact_probes import artifact_store_finding
from sandboxd.core.settings import DaemonSettings


def test_the_local_store_needs_nothing_more(tmp_path):
    finding = artifact_store_finding(DaemonSettings(state_dir=tmp_path))
    assert (finding.probe, finding.status) == ("artifact-store", "ok")
    assert str(tmp_path / "blobs") in finding.reason


def test_a_loose_credentials_file_fails_the_check_naming_the_setting(tmp_path):
    creds = tmp_path / "creds"
    creds.write_text("[default]\naws_access_key_id = a\naws_secret_access_key = b\n")
    creds.chmod(0o644)
    settings = DaemonSettings(state_dir=tmp_path, artifacts={
        "store": "s3", "endpoint_url": "http://127.0.0.1:9", "credentials_file": str(creds)})
    finding = artifact_store_finding(settings)
    assert (finding.status, finding.field) == ("fail", "artifacts.credentials_file")
    assert "mode 0600" in finding.reason and finding.needed_by == ("daemon",)
