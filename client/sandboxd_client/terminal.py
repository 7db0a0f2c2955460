"""What a sandbox wrote, shown on a terminal without letting it drive the terminal.

A command's output, a diff, an artifact, a file name are the sandbox's bytes: printed raw,
`ESC[1A ESC[2K` erases the line before it (a `+curl ... | sh` in a diff a reviewer
reads), a carriage return or a backspace overwrites it, OSC 52 sets the clipboard, and
bidirectional overrides show code in another order than it runs. So on a terminal every
control character but newline and tab is shown as an escape: C0 controls, DEL, C1
controls (as bytes and as code points), the bidi overrides and isolates, and bytes that
are not UTF-8 (`\\x1b`, `\\r`, `\\x9b`, `\\u202e`). A pipe or a file gets the bytes as
they are, and so does a terminal with `--raw`."""

from __future__ import annotations

import codecs
from typing import Any, BinaryIO, TextIO

_KEPT = "\n\t"
_BIDI = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
_NAMED = {"\r": "\\r"}


def _escape(ch: str) -> str:
    n = ord(ch)
    return _NAMED.get(ch) or (f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}")


_TABLE = {ord(ch): _escape(ch) for ch in [*map(chr, range(0x20)), *map(chr, range(0x7f, 0xa0)), *_BIDI]
          if ch not in _KEPT}


def visible(text: str) -> str:
    """`text` with every control character but newline and tab written as an escape."""
    return text.translate(_TABLE)


class VisibleBytes:
    """A stream of bytes made visible chunk by chunk: a UTF-8 character split between
    two chunks is kept whole, a byte that is not UTF-8 is shown as \\xNN."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("backslashreplace")

    def feed(self, data: bytes, final: bool = False) -> bytes:
        return visible(self._decoder.decode(data, final)).encode("utf-8")


def on_terminal(stream: Any, raw: bool = False) -> bool:
    """Whether what goes to `stream` is made visible: it is a terminal and --raw was
    not given."""
    if raw:
        return False
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed, or no file at all
        return False


class Sink:
    """Where a sandbox's bytes go: `stream` as they are, or made visible (`escape`).
    `close` writes what a split character held back, and flushes."""

    def __init__(self, stream: BinaryIO, escape: bool):
        self._stream = stream
        self._visible = VisibleBytes() if escape else None

    def write(self, data: bytes) -> int:
        self._stream.write(self._visible.feed(data) if self._visible else data)
        return len(data)

    def flush(self) -> None:
        self._stream.flush()

    def close(self) -> None:
        if self._visible is not None:
            self._stream.write(self._visible.feed(b"", final=True))
        self._stream.flush()


def sink(stream: TextIO, raw: bool = False) -> Sink:
    """The sink for sys.stdout or sys.stderr: made visible when it is a terminal."""
    return Sink(stream.buffer, on_terminal(stream, raw))
