"""`sandboxd check`'s probe of the artifact store: the local one needs nothing beyond
the state directory (dirs.py); the S3 one is reached as the daemon's start reaches it
(ledger/s3_blobs.s3_store): a missing bucket or refused credentials stop the start,
while a store that does not answer yet only delays uploads (blobs wait locally)."""

from __future__ import annotations

from sandboxd.check.report import DAEMON, Finding
from sandboxd.core.artifact_settings import mask_userinfo
from sandboxd.core.errors import SandboxdError
from sandboxd.core.settings import DaemonSettings

PROBE = "artifact-store"


def artifact_store_finding(settings: DaemonSettings) -> Finding:
    caps = settings.artifacts
    if caps.store == "local":
        return Finding(PROBE, "ok", f"local: blobs under {settings.blob_dir}", needed_by=(DAEMON,))
    from sandboxd.ledger.blobs import BlobStoreUnavailable  # boto3 only when S3 is configured
    from sandboxd.ledger.s3_blobs import s3_store

    where = f"{caps.endpoint_shown}/{caps.bucket}/{caps.prefix}"  # never the endpoint's user:password@
    try:
        store = s3_store(caps)
    except SandboxdError as exc:
        return Finding(PROBE, "fail", f"S3 at {where}: {exc.reason}", needed_by=(DAEMON,),
                       field=exc.field or "artifacts")
    except (OSError, ValueError) as exc:  # boto3 refusing its arguments: its text may quote the endpoint
        return Finding(PROBE, "fail", f"S3 at {where}: {mask_userinfo(str(exc))}", needed_by=(DAEMON,),
                       field="artifacts")
    try:
        store.check_bucket()
    except BlobStoreUnavailable as exc:
        return Finding(PROBE, "warn", f"S3 at {where} does not answer ({exc.reason}): the daemon starts, and "
                                      "blobs wait in the local store until it does", field="artifacts.endpoint_url")
    finally:
        store.close()
    return Finding(PROBE, "ok", f"S3 at {where}: the bucket answers (blobs land locally, then are uploaded)",
                   needed_by=(DAEMON,))
