"""Streaming redaction of secrets in a call's output: every occurrence of a secret's
value, or of its common encodings (base64 at any alignment, URL-safe base64, hex,
percent-encoding), becomes `[REDACTED:<binding id>]`, also when it is split across
the chunks the command happened to write. Pure: bytes in, bytes out."""

from __future__ import annotations

import base64
import re
from urllib.parse import quote

# Encodings shorter than this are not redacted on their own (they would match noise);
# the secret's raw value always is.
MIN_ENCODED_LENGTH = 8


def _b64_variants(value: bytes) -> set[bytes]:
    """The base64 text that `value` produces wherever it sits in a longer input: for
    each of the three alignments, only the characters that depend on `value` alone."""
    out = set()
    for k in range(3):
        encoded = base64.b64encode(b"\0" * k + value + b"\0\0")
        first = -(-8 * k // 6)  # ceil: the first character made of value's bits only
        last = (8 * (k + len(value))) // 6  # one past the last such character
        core = encoded[first:last]
        if len(core) >= MIN_ENCODED_LENGTH:
            out.add(core)
            out.add(core.translate(bytes.maketrans(b"+/", b"-_")))
    return out


def encodings(value: bytes) -> set[bytes]:
    """Every form of `value` the redactor looks for."""
    forms = {value} | _b64_variants(value)
    for extra in (value.hex().encode(), value.hex().upper().encode(), quote(value, safe="").encode()):
        if len(extra) >= MIN_ENCODED_LENGTH:
            forms.add(extra)
    return {f for f in forms if f}


class Redactor:
    """One per call; `feed` and `flush` per output stream (stdout and stderr are
    independent). Holds back only the bytes that could still become a secret when the
    next chunk arrives (the longest tail that begins some form of one), so output that
    cannot be a secret streams at once."""

    def __init__(self, secrets: dict[str, bytes]):
        self._replacement: dict[bytes, bytes] = {}
        for binding, value in sorted(secrets.items()):
            for form in encodings(value):
                self._replacement.setdefault(form, f"[REDACTED:{binding}]".encode())
        forms = sorted(self._replacement, key=len, reverse=True)  # longest first wins
        self._pattern = re.compile(b"|".join(re.escape(f) for f in forms)) if forms else None
        self._forms = forms
        self._hold = max((len(f) for f in forms), default=1) - 1
        self._pending: dict[int, bytes] = {}

    def _unfinished_tail(self, buf: bytes) -> int:
        """Length of the longest tail of `buf` that is the start of some form."""
        for k in range(min(len(buf), self._hold), 0, -1):
            tail = buf[-k:]
            if any(f.startswith(tail) for f in self._forms):
                return k
        return 0

    @property
    def active(self) -> bool:
        return self._pattern is not None

    def feed(self, stream: int, data: bytes) -> bytes:
        """What may be passed on now, redacted."""
        if self._pattern is None:
            return data
        buf = self._pending.pop(stream, b"") + bytes(data)
        # Any match that could still grow starts in the unfinished tail; one before it is whole.
        safe_end = len(buf) - self._unfinished_tail(buf)
        out = bytearray()
        i = 0
        for m in self._pattern.finditer(buf):
            if m.start() >= safe_end:
                break
            out += buf[i:m.start()] + self._replacement[m.group()]
            i = m.end()
        keep_from = max(i, safe_end)
        out += buf[i:keep_from]
        self._pending[stream] = buf[keep_from:]
        return bytes(out)

    def flush(self, stream: int) -> bytes:
        """The rest of a stream at its end, redacted."""
        if self._pattern is None:
            return b""
        rest = self._pending.pop(stream, b"")
        return self._pattern.sub(lambda m: self._replacement[m.group()], rest)
