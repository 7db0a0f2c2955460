"""The output redactor against the forms the red-team used (issue 20): line-wrapped
base64, hex with separators or escapes, other letter case, a value folded over lines,
and `redact_text` for the strings of events. Also what it deliberately does not join
(a value split across stdout and stderr) and its bounds. Pure: no Docker."""

from __future__ import annotations

import base64
import random
import textwrap
import time
from pathlib import Path

import pytest

from sandboxd.sandbox.output import STDERR, STDOUT, OutputSpool
from sandboxd.secrets.redact import Redactor

SECRET = b"sk-live-4f9a8b7c6d5e4f3a2b1cXyZ"
BIN = bytes(random.Random(9).randrange(256) for _ in range(32))
MARK = b"[REDACTED:k]"


def run(red: Redactor, chunks, stream: int = STDOUT) -> bytes:
    return b"".join(red.feed(stream, c) for c in chunks) + red.flush(stream)


def random_split(data: bytes, rng: random.Random, max_chunk: int) -> list[bytes]:
    out, i = [], 0
    while i < len(data):
        n = rng.randint(1, max_chunk)
        out.append(data[i:i + n])
        i += n
    return out


def leaks(out: bytes, value: bytes) -> list[bytes]:
    """8-character windows of the value's hex and base64 (any alignment, any case) or
    of the value itself still present in `out`, line breaks and separators removed."""
    flat = out.lower()
    for sep in (b"\n", b"\r", b" ", b":", b"-", b"\\x", b"0x", b","):
        flat = flat.replace(sep, b"")
    texts = [value.hex().encode(), value.lower().replace(b"-", b"")]
    for k in range(3):
        texts.append(base64.b64encode(b"\0" * k + value).lower()[4:-4])
    return [t[i:i + 8] for t in texts for i in range(len(t) - 7) if t[i:i + 8] in flat]


def check(secret: bytes, text: bytes, *, min_marks: int = 1) -> None:
    """`text` redacted whole and in random chunkings, each time the same, with at
    least `min_marks` marks and nothing of the secret left."""
    want = run(Redactor({"k": secret}), [text])
    assert want.count(MARK) >= min_marks, want
    assert not leaks(want, secret), (leaks(want, secret), want)
    rng = random.Random(len(text))
    for max_chunk in (1, 3, 17, 200):
        assert run(Redactor({"k": secret}), random_split(text, rng, max_chunk)) == want, max_chunk


# ------------------------------------------------------------------ line-wrapped base64


@pytest.mark.parametrize("width", [76, 64, 16, 5])
@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
@pytest.mark.parametrize("pad", [0, 1, 2])
@pytest.mark.parametrize("secret", [SECRET, BIN])
def test_line_wrapped_base64_at_every_alignment(secret, pad, newline, width):
    doc = b"x" * (37 + pad) + secret + b"y" * 40
    encoded = base64.b64encode(doc)
    wrapped = newline.join(encoded[i:i + width] for i in range(0, len(encoded), width)) + newline
    check(secret, b"-----BEGIN DATA-----" + newline + wrapped + b"-----END DATA-----" + newline)


def test_mime_encodebytes_and_indented_yaml_block():
    text = base64.encodebytes(b"." * 50 + SECRET + b"." * 50)
    check(SECRET, text)
    yaml = b"data: |\n" + textwrap.indent(base64.encodebytes(b"," * 7 + SECRET).decode(), "    ").encode()
    check(SECRET, yaml)


# ------------------------------------------------------------------ hex with separators, escapes, case


def hex_forms(value: bytes) -> list[bytes]:
    h = value.hex()
    pairs = [h[i:i + 2] for i in range(0, len(h), 2)]
    return [
        ":".join(pairs).encode(), " ".join(pairs).encode(), "-".join(pairs).encode(),
        ":".join(pairs).upper().encode(), " ".join(p.upper() for p in pairs).encode(),
        "".join(c.upper() if i % 3 else c for i, c in enumerate(h)).encode(),  # mixed case
        "\n".join(h[i:i + 30] for i in range(0, len(h), 30)).encode(),  # xxd -p wraps at 60
        "".join("\\x" + p for p in pairs).encode(), "".join("\\x" + p.upper() for p in pairs).encode(),
        ", ".join("0x" + p for p in pairs).encode(), ",".join("0X" + p.upper() for p in pairs).encode(),
        "  ".join(" ".join(pairs[i:i + 8]) for i in range(0, len(pairs), 8)).encode(),  # hexdump's double blank
    ]


@pytest.mark.parametrize("form", range(12))
@pytest.mark.parametrize("secret", [SECRET, BIN, b"\xde\xad\xbe\xef\x00\x11\x22\x33"])
def test_hex_with_separators_escapes_and_any_case(secret, form):
    text = b"key = " + hex_forms(secret)[form] + b";\n"
    check(secret, text)


def test_the_red_team_hex_examples():
    secret = b"\xde\xad\xbe\xef\xca\xfe\xba\xbe"
    for text in (b"de:ad:be:ef:ca:fe:ba:be", b"de ad be ef ca fe ba be", b"de-ad-be-ef-ca-fe-ba-be",
                 b"DEADBEEFCAFEBABE", b"DeAdBeEfCaFeBaBe"):
        assert run(Redactor({"k": secret}), [b"<" + text + b">"]) == b"<" + MARK + b">", text


# ------------------------------------------------------------------ the value itself


@pytest.mark.parametrize("transform", [bytes.upper, bytes.lower, bytes.swapcase, bytes.title,
                                       lambda v: b"\n".join(v[i:i + 5] for i in range(0, len(v), 5)),  # fold -w5
                                       lambda v: b"\r\n".join(v[i:i + 1] for i in range(len(v))),  # one char per line
                                       lambda v: b" ".join(v[i:i + 1] for i in range(len(v)))])
def test_the_value_in_other_case_or_folded_over_lines(transform):
    check(SECRET, b"token: " + transform(SECRET) + b"\n")


def test_percent_encoding_in_lower_case_hex():
    secret = b"p@ss w/rd:1?&=xyz"
    text = b"pw=p%40ss%20w%2frd%3a1%3f%26%3dxyz&x=1\n"
    assert run(Redactor({"k": secret}), [text]) == b"pw=" + MARK + b"&x=1\n"


def test_separators_around_a_match_stay_in_place():
    red = Redactor({"k": SECRET})
    assert run(red, [b"a: " + SECRET + b" \n"]) == b"a: " + MARK + b" \n"


# ------------------------------------------------------------------ streams, bounds, the spool


def test_a_value_split_across_stdout_and_stderr_is_not_caught():
    # Documented limit (DESIGN-NOTES M6): each stream is matched on its own, so a secret
    # written half to each cannot be found in either without also striking innocent text.
    red = Redactor({"k": SECRET})
    out = red.feed(STDOUT, SECRET[:15]) + red.flush(STDOUT)
    err = red.feed(STDERR, SECRET[15:]) + red.flush(STDERR)
    assert out + err == SECRET


def test_what_is_held_is_bounded_however_many_separators_follow():
    red = Redactor({"k": SECRET})
    emitted = red.feed(STDOUT, b"sk")
    for _ in range(200):
        emitted += red.feed(STDOUT, b"\n" * 4096)
        assert len(red._pending[STDOUT]) <= 1024  # of 800 KiB fed
    assert emitted.startswith(b"sk\n")
    # A secret that does arrive in one write is still struck.
    assert red.feed(STDOUT, b"x" + SECRET + b"!") == b"x" + MARK + b"!"


def test_a_long_secret_spread_over_separators_within_one_write_is_struck():
    red = Redactor({"k": SECRET})
    assert run(red, [b"\n\n".join(SECRET[i:i + 1] for i in range(len(SECRET)))]) == MARK


def test_spool_stores_and_previews_the_new_forms_redacted(tmp_path: Path):
    wrapped = base64.encodebytes(b"=" * 40 + SECRET + b"=" * 40)
    hexed = b"\n" + b":".join(b"%02X" % b for b in SECRET) + b"\n"
    spool = OutputSpool(tmp_path / "s", {STDOUT: 1 << 20, STDERR: 1 << 20}, 4096, Redactor({"k": SECRET}))
    rng = random.Random(4)
    for part in random_split(wrapped + hexed, rng, 7):
        spool.write(STDOUT, part)
    spool.write(STDERR, SECRET.upper())
    spool.close()
    stdout = (tmp_path / "s" / "stdout.out").read_bytes()
    stderr = (tmp_path / "s" / "stderr.out").read_bytes()
    assert stdout.count(MARK) == 2 and not leaks(stdout, SECRET)
    assert stderr == MARK
    assert spool.summary(STDOUT).preview.encode() == stdout


# ------------------------------------------------------------------ redact_text


def test_redact_text_without_secrets_is_the_identity_and_fast():
    red = Redactor({})
    s = "/workspace/src/main.py"
    assert red.redact_text(s) is s
    red = Redactor({"k": SECRET})
    assert red.redact_text(s) is s
    assert red.redact_text("") == ""
    start = time.perf_counter()
    for _ in range(20000):
        red.redact_text("GET")
        red.redact_text("files.pythonhosted.org")
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("text, want", [
    ("/tmp/" + SECRET.decode() + ".txt", "/tmp/[REDACTED:k].txt"),  # a file named after it
    (SECRET.decode(), "[REDACTED:k]"),  # an HTTP method
    (SECRET.hex() + ".denied.test", "[REDACTED:k].denied.test"),  # a hex label
    (SECRET.hex()[:40] + "." + SECRET.hex()[40:] + ".denied.test", "[REDACTED:k].denied.test"),  # labels <= 63
    (SECRET.hex().upper() + ".DENIED.TEST:443", "[REDACTED:k].DENIED.TEST:443"),  # a CONNECT target
    ("/x/" + base64.urlsafe_b64encode(SECRET).decode().rstrip("=") + "/y", None),
    ("café/" + SECRET.decode() + "/ü", "café/[REDACTED:k]/ü"),
    ("bad\udcff/" + SECRET.decode(), "bad\udcff/[REDACTED:k]"),  # a path that is not UTF-8
])
def test_redact_text_strikes_every_form(text, want):
    got = Redactor({"k": SECRET}).redact_text(text)
    if want is not None:
        assert got == want
    assert "[REDACTED:k]" in got
    assert not leaks(got.encode("utf-8", "surrogateescape"), SECRET)


def test_redact_text_names_each_binding():
    red = Redactor({"a": b"alpha-secret-1", "b": b"beta-secret-22"})
    assert red.redact_text("alpha-secret-1/beta-secret-22") == "[REDACTED:a]/[REDACTED:b]"


def test_redact_text_leaves_the_streams_alone():
    red = Redactor({"k": SECRET})
    assert red.feed(STDOUT, b"sk-live") == b""
    assert red.redact_text("sk-live-x") == "sk-live-x"
    assert red.feed(STDOUT, SECRET[7:]) == MARK


def test_a_whole_secret_in_the_part_released_by_the_bound_is_still_struck():
    # A tail that could begin a longer form is held, but only so far: what the bound
    # releases is matched first, so a whole form inside it never leaves unstruck.
    secrets = {"long": b"abcdefgh-0123456789-tail", "short": b"abcdefgh"}
    red = Redactor(secrets)
    text = b"a\nb\nc\nd\ne\nf\ng\nh" + b"\n" * 5000
    out = red.feed(STDOUT, text)
    assert out.startswith(b"[REDACTED:short]")
    assert out + red.flush(STDOUT) == b"[REDACTED:short]" + b"\n" * 5000
