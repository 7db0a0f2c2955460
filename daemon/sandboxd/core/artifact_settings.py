"""ArtifactSettings: where artifact blobs are kept and what a call leaves behind as
artifacts (its changed files, the diff, persistOutputs' files); TransferSettings: the caps
of files put in and taken out (FileService). Their own module: the
settings' one file had no room left; gen-config-docs reads the comments here too."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field

# A URL's userinfo ("user:password@" after "scheme://"): up to the last "@" before the
# host's end, as urlsplit reads it (a sloppy "user:p@ss@host" is masked whole).
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#\s]*@")
MASKED_USERINFO = "***@"


def mask_userinfo(text: str) -> str:
    """`text` with the userinfo of every URL in it masked ("http://***@host"): what may be
    printed or logged of a URL an operator wrote (its password is a secret)."""
    return _USERINFO.sub(lambda m: m.group(1) + MASKED_USERINFO, text)


def without_userinfo(url: str) -> str:
    """`url` with no userinfo at all: what is handed to a library that may print or log
    it (boto3 sends none of it: S3 requests are signed with the credentials)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


class ArtifactSettings(BaseModel):
    """Where artifact blobs are kept (ledger/blobs.py, s3_blobs.py; every read verifies their sha256) and
    which files a call leaves as artifacts (outputs/)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    store: Literal["local", "s3"] = "local"  # `local`: <state_dir>/blobs only; `s3`: the S3-compatible store below
    endpoint_url: str | None = Field(default=None, pattern=r"^https?://")  # The S3 API's URL, e.g. http://127.0.0.1:8333; unset: AWS
    bucket: str = Field(default="sandboxd", min_length=3, max_length=63)  # An existing bucket (the daemon creates none).
    prefix: str = Field(default="", pattern=r"^([\w.-]+/)*$")  # Put before every key `sha256/<ab>/<hex>`, e.g. "sandboxd/"
    region: str = "us-east-1"  # The region requests are signed for
    credentials_file: Path | None = None  # An AWS-style credentials file ([default], mode 0600); unset: AWS_* env
    addressing_style: Literal["path", "virtual", "auto"] = "path"  # The bucket in the URL's path (most servers) or host
    # Blobs larger than this go to S3 in parts (one PUT stops at 5 GB), each part's MD5 checked.
    multipart_threshold_mb: int = Field(default=256, ge=5, le=5 * 1024)
    # Keep each file a call created or modified under its write roots as a `file` artifact.
    collect_files: bool = True
    # Per call, at most this many file artifacts (changed files and persistOutputs' files together).
    max_files_per_call: int = Field(default=256, ge=0, le=10_000)
    # Per call, at most this many bytes of file artifacts; a file that would pass it is left out, and said.
    max_collected_mb_per_call: int = Field(default=1024, ge=0)
    # Make a `diff` artifact: the changed text files against their content before the call.
    diff: bool = True
    # Text files larger than this (before or after the call) are named in the diff, not diffed.
    diff_max_file_kb: int = Field(default=1024, ge=1)
    # The diff artifact's cap; past it, the rest of the changed files are only named.
    diff_max_mb: int = Field(default=16, ge=1)
    # Text files of the write roots kept as they were hashed (<state_dir>/baseline), so the diff has
    # their content before a call; the oldest go first past this size.
    baseline_max_mb: int = Field(default=256, ge=0)

    @property
    def endpoint_shown(self) -> str:
        """Where the store is, as it may be printed or logged (userinfo masked)."""
        return mask_userinfo(self.endpoint_url) if self.endpoint_url else "aws"


class TransferSettings(BaseModel):
    """FileService's caps: files put into or taken out of a workspace or a leased sandbox (transfer/).
    A transfer past a cap is refused before any byte of it lands or is sent."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # The most bytes one upload may carry (the files' declared sizes, summed).
    max_upload_mb: int = Field(default=1024, ge=0)
    # The most bytes one download may send (the tree's sizes, summed before the first byte).
    max_download_mb: int = Field(default=1024, ge=0)
    # The most files and directories in one transfer.
    max_entries: int = Field(default=10_000, ge=1, le=1_000_000)
