"""Redaction of the forms the red-team printed (issue 20), for real on both backends: a
credential bound as env, printed line-wrapped in base64, as hex with separators or
escapes, in other case and folded over lines; the live stream, the stored artifacts and
the previews hold `[REDACTED:<binding>]` and nothing of the value."""

from __future__ import annotations

import base64
import io
import textwrap

import pytest

from sandboxd_testing import make_daemon
from sandboxd_contract.pb import sandboxd_pb2 as pb

from .conftest import BACKENDS, DAEMON_ENV, AdapterClient, call, public_tmpdir, stop_and_clean

SECRET = "tok-Live-9f8E7d6C5b4A3210-xyzQ"

SCRIPT = textwrap.dedent("""
    import base64, os, sys
    s = os.environ["TOKEN"].encode()
    out = sys.stdout.buffer
    out.write(b"mime:\\n" + base64.encodebytes(b"." * 41 + s + b"." * 60))
    pem = base64.b64encode(b"ab" + s + b"." * 50)
    out.write(b"pem:\\r\\n" + b"\\r\\n".join(pem[i:i + 64] for i in range(0, len(pem), 64)) + b"\\r\\n")
    out.write(b"colons: " + b":".join(b"%02X" % c for c in s) + b"\\n")
    out.write(b"spaced: " + b" ".join(b"%02x" % c for c in s) + b"\\n")
    out.write(b"escaped: " + b"".join(b"\\\\x%02x" % c for c in s) + b"\\n")
    out.write(b"upper: " + s.upper() + b"\\n")
    out.write(b"folded:\\n" + b"\\n".join(s[i:i + 4] for i in range(0, len(s), 4)) + b"\\n")
    out.flush()
    sys.stderr.buffer.write(b"stderr: " + s.hex().upper().encode() + b"\\n")
""")


@pytest.fixture(scope="module")
def forms_daemon(docker_engine):
    base = public_tmpdir("sandboxd-redact-forms-")
    d = make_daemon(base / "d", env={**DAEMON_ENV, "SANDBOXD_FORMS_TOKEN": SECRET}, credentials={
        "tok": {"env": "SANDBOXD_FORMS_TOKEN", "principals": ["root"]},
    }).start()
    yield d
    stop_and_clean(d, docker_engine, base)


def leaked(data: bytes) -> list[str]:
    """8-character windows of the value, its hex or base64 (any alignment) still in
    `data`, compared without case, line breaks or separators."""
    flat = data.lower()
    for sep in (b"\n", b"\r", b" ", b":", b"\\x"):
        flat = flat.replace(sep, b"")
    raw = SECRET.encode()
    texts = [raw.lower(), raw.hex().encode()] + [base64.b64encode(b"\0" * k + raw).lower()[4:-4] for k in range(3)]
    return [t[i:i + 8].decode() for t in texts for i in range(len(t) - 7) if t[i:i + 8] in flat]


@pytest.mark.parametrize("adapter", BACKENDS)
def test_printed_forms_are_redacted_in_stream_artifacts_and_previews(forms_daemon, adapter):
    c = AdapterClient(str(forms_daemon.socket), adapter)
    try:
        cmd = call(forms_daemon.new_workspace(), ["python3", "-c", SCRIPT],
                   {"environment": {"secretEnvAllowed": True}})
        cmd["credentialRefs"] = [{"bindingId": "tok", "envName": "TOKEN"}]
        streamed = {1: b"", 2: b""}
        result, call_id = None, ""
        for event in c.execute(cmd):
            call_id = event.tool_call_id
            kind = event.WhichOneof("kind")
            if kind == "output":
                streamed[1 if event.output.stream == pb.OUTPUT_STREAM_STDOUT else 2] += event.output.data
            elif kind == "finished":
                result = event.finished.result
        assert result is not None and result.status == "success", streamed[2]
        stored = b""
        for ref in c.list_artifacts(call_id):
            buf = io.BytesIO()
            c.download_artifact(ref.artifact_id, buf)
            stored += buf.getvalue()
        previews = (result.stdout_preview + result.stderr_preview).encode()
        for where, data in (("stream", streamed[1] + streamed[2]), ("artifacts", stored), ("previews", previews)):
            assert not leaked(data), (where, leaked(data), data)
        text = streamed[1].decode()
        for label in ("colons", "spaced", "escaped", "upper"):
            assert f"{label}: [REDACTED:tok]\n" in text, text
        assert text.count("[REDACTED:tok]") >= 7, text
        assert streamed[2] == b"stderr: [REDACTED:tok]\n"
        assert stored.count(b"[REDACTED:tok]") == text.count("[REDACTED:tok]") + 1
    finally:
        c.close()
