"""Redaction of secrets in a call's output and in the strings of its events: every
occurrence of a secret's value, or of its common encodings (base64 at any alignment,
URL-safe base64, hex, `\\x`/`0x` escapes, percent-encoding), becomes
`[REDACTED:<binding id>]`, also when the output splits it across chunks.

Matching is done on a *skeleton* of the text: ASCII letters folded to lower case and the
separator bytes SEPARATORS dropped; each form is reduced the same way. So a form still
matches when it is upper- or mixed-case (hex, the value itself), line-wrapped (base64 at
76 or 64 columns, `fold`, CRLF), or written with separators (`de:ad:be:ef`,
`de ad be ef`, `de-ad`, `0xde, 0xad`). The skeleton is made with bytes.lower and
bytes.translate (C loops), so the cost per byte stays that of one regular-expression
scan. Separators at a match's edges are left in place. Pure: bytes in, bytes out."""

from __future__ import annotations

import base64
import bisect
from urllib.parse import quote

# Encodings shorter than this are not redacted on their own (they would match noise);
# the secret's raw value always is.
MIN_ENCODED_LENGTH = 8
# Dropped from both the text and the forms before matching: line breaks, blanks and the
# separators people put between hex bytes. A form made only of them is never matched.
SEPARATORS = b"\t\n\v\f\r ,-./:"
# A held tail is bounded: a secret spread over more than this many separator bytes per
# character is caught within one chunk, not across chunks (see DESIGN-NOTES M6).
_GAP_PER_CHAR = 3
_PROBE = 8  # form prefixes of this length find the candidate starts of a held tail


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
    """Every form of `value` the redactor looks for (before case folding and the
    dropping of separators)."""
    forms = {value} | _b64_variants(value)
    hexed = value.hex()
    extras = (hexed.encode(), hexed.upper().encode(), quote(value, safe="").encode(),
              "".join("\\x" + hexed[i:i + 2] for i in range(0, len(hexed), 2)).encode(),
              "".join("0x" + hexed[i:i + 2] for i in range(0, len(hexed), 2)).encode())
    for extra in extras:
        if len(extra) >= MIN_ENCODED_LENGTH:
            forms.add(extra)
    return {f for f in forms if f}


def skeleton(data: bytes) -> bytes:
    """What matching sees of `data`: lower case, no SEPARATORS."""
    return data.lower().translate(None, SEPARATORS)


class _OffsetMap:
    """Skeleton offsets back to offsets in the text it was made from, walking forward
    only (matches come in order); each step counts separators with C loops."""

    def __init__(self, low: bytes, dense: bool):
        self._low = low
        self._sk = 0
        self._orig = 0
        self._dense = dense  # no separator at all: the offsets are the same

    def orig(self, k: int) -> int:
        """The index in the text of skeleton byte k (len(text) past the last one)."""
        if self._dense:
            return k
        if k < self._sk:
            self._sk = self._orig = 0
        low, i, need = self._low, self._orig, k - self._sk
        while need > 0:
            seg = low[i:i + need]
            i += len(seg)
            need -= len(seg.translate(None, SEPARATORS))
            if not seg:
                break
        while i < len(low) and low[i] in SEPARATORS:
            i += 1
        self._sk, self._orig = k, i
        return i


class Redactor:
    """One per call; `feed` and `flush` per output stream (stdout and stderr are
    independent), `redact_text` for one whole string. Holds back only the bytes that
    could still become a secret when the next chunk arrives (the longest tail whose
    skeleton begins some form), so output that cannot be a secret streams at once."""

    def __init__(self, secrets: dict[str, bytes]):
        self._replacement: dict[bytes, bytes] = {}
        for binding, value in sorted(secrets.items()):
            for form in encodings(value):
                sk = skeleton(form)
                if sk:
                    self._replacement.setdefault(sk, f"[REDACTED:{binding}]".encode())
        forms = list(self._replacement)
        self._forms = forms
        self._sorted = sorted(forms)
        self._probes = {f[:_PROBE] for f in forms}
        self._short_prefixes = {f[:k] for f in forms for k in range(1, min(len(f) - 1, _PROBE) + 1)}
        self._hold = max((len(f) for f in forms), default=1) - 1
        self._hold_cap = (self._hold + 1) * (1 + _GAP_PER_CHAR) + 64
        self._pending: dict[int, bytes] = {}

    @property
    def active(self) -> bool:
        return bool(self._forms)

    def _matches(self, sk: bytes, before: int) -> list[tuple[int, int]]:
        """The (start, end) of the forms struck in `sk`, among those starting before
        `before`: leftmost first, the longest at one start, none overlapping another.
        One bytes.find scan per form (C, several hundred MB/s each) beats one regular
        expression with every form as an alternative by 3-10 times, more with more
        secrets."""
        found = []
        for form in self._forms:
            n = len(form)
            i = sk.find(form, 0, before + n - 1)
            while i >= 0:
                found.append((i, -n))
                i = sk.find(form, i + 1, before + n - 1)
        if len(found) > 1:
            found.sort()
        out = []
        last = 0
        for start, neg in found:
            if start >= last:
                last = start - neg
                out.append((start, last))
        return out

    def _begins_a_longer_form(self, tail: bytes) -> bool:
        i = bisect.bisect_right(self._sorted, tail)  # past `tail` itself if it is a form
        return i < len(self._sorted) and self._sorted[i].startswith(tail)

    def _unfinished_tail(self, sk: bytes) -> int:
        """Skeleton offset of the longest tail of `sk` that more bytes could still turn
        into (a longer) form, len(sk) if none. Separators never finish a form: a whole
        form at the end is final unless a longer one begins with it."""
        n = len(sk)
        for start in range(max(0, n - self._hold), n):
            if n - start >= _PROBE:
                if sk[start:start + _PROBE] in self._probes and self._begins_a_longer_form(sk[start:]):
                    return start
            elif sk[start:] in self._short_prefixes:
                return start
        return n

    def _redact(self, buf: bytes, final: bool) -> tuple[bytes, int]:
        """`buf` redacted up to the offset returned; the rest (only when not `final`)
        could still grow into a secret."""
        low = buf.lower()
        sk = low.translate(None, SEPARATORS)
        dense = len(sk) == len(low)
        hold_from = len(buf)
        safe = len(sk)
        if not final:
            safe = self._unfinished_tail(sk)
            hold_from = _OffsetMap(low, dense).orig(safe)
            if len(buf) - hold_from > self._hold_cap:
                # Held memory stays bounded: the older part goes, struck as a whole text.
                hold_from = len(buf) - self._hold_cap
                safe = len(low[:hold_from].translate(None, SEPARATORS))
        offsets = _OffsetMap(low, dense)
        out = bytearray()
        i = 0
        for s_start, s_end in self._matches(sk, safe):
            start, end = offsets.orig(s_start), offsets.orig(s_end - 1) + 1
            out += buf[i:start] + self._replacement[sk[s_start:s_end]]
            i = end
        keep_from = max(i, hold_from)
        out += buf[i:keep_from]
        return bytes(out), keep_from

    def feed(self, stream: int, data: bytes) -> bytes:
        """What may be passed on now, redacted."""
        if not self._forms:
            return data
        buf = self._pending.pop(stream, b"") + bytes(data)
        out, keep_from = self._redact(buf, final=False)
        self._pending[stream] = buf[keep_from:]
        return out

    def flush(self, stream: int) -> bytes:
        """The rest of a stream at its end, redacted."""
        if not self._forms:
            return b""
        rest = self._pending.pop(stream, b"")
        return self._redact(rest, final=True)[0] if rest else b""

    def redact_text(self, s: str) -> str:
        """`s` whole (an event's path, host, method...) with every form of every secret
        replaced; `s` itself when there is nothing to strike."""
        if not self._forms or not s:
            return s
        errors = "surrogateescape"
        try:
            data = s.encode("utf-8", errors)
        except UnicodeEncodeError:  # a lone surrogate that no file name decoding made
            errors = "surrogatepass"
            data = s.encode("utf-8", errors)
        sk = skeleton(data)
        if not any(form in sk for form in self._forms):
            return s
        return self._redact(data, final=True)[0].decode("utf-8", errors)
