"""Long output cut for the model: the head and the tail kept, the middle replaced by a
marker that says how much was cut and where the whole of it is. A model reading a build
log needs its start (what ran) and its end (what failed) far more than its middle."""

from __future__ import annotations

from dataclasses import dataclass

# Below this a budget leaves no room for a useful head and tail beside the marker.
MIN_BUDGET_BYTES = 256
# A cut moves to a line boundary when one lies within this share of the kept part.
_LINE_SLACK = 4


@dataclass(frozen=True)
class Capped:
    """Text for the model: `text` holds at most the budget's bytes of the output (plus the
    marker); `cut_bytes` of the middle are not in it (0: the output is whole)."""

    text: str
    total_bytes: int
    cut_bytes: int = 0
    cut_lines: int = 0

    @property
    def cut(self) -> bool:
        return self.cut_bytes > 0


def _utf8_head(data: bytes) -> bytes:
    """`data` without a UTF-8 sequence that its end splits."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead byte (or ASCII): does its sequence fit?
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return data if need <= back else data[:-back]
    return data


def _utf8_tail(data: bytes) -> bytes:
    """`data` without the continuation bytes of a sequence that began before it."""
    start = 0
    while start < min(3, len(data)) and data[start] & 0xC0 == 0x80:
        start += 1
    return data[start:]


def _head(data: bytes, size: int) -> bytes:
    head = data[:size]
    newline = head.rfind(b"\n")
    if newline >= 0 and size - newline <= size // _LINE_SLACK:
        head = head[:newline + 1]
    return _utf8_head(head)


def _tail(data: bytes, size: int) -> bytes:
    tail = data[len(data) - size:] if size else b""
    newline = tail.find(b"\n")
    if 0 <= newline < size // _LINE_SLACK and newline + 1 < len(tail):
        tail = tail[newline + 1:]
    return _utf8_tail(tail)


def cap_output(data: bytes, budget_bytes: int, *, stream: str, whole_at: str) -> Capped:
    """`data` as text of at most `budget_bytes` bytes: whole when it fits, else its head
    and tail (half the budget each, moved to a line boundary when one is near) around a
    marker naming `stream`, what was cut and `whole_at` (where the whole output is)."""
    if budget_bytes < MIN_BUDGET_BYTES:
        raise ValueError(f"an output budget must be at least {MIN_BUDGET_BYTES} bytes")
    if len(data) <= budget_bytes:
        return Capped(data.decode("utf-8", "replace"), len(data))
    head = _head(data, budget_bytes // 2)
    tail = _tail(data, budget_bytes - budget_bytes // 2)
    middle = data[len(head):len(data) - len(tail)]
    lines = middle.count(b"\n")
    marker = (f"\n[... sandboxd-mcp cut {len(middle)} bytes ({lines} line breaks) from the middle of {stream}; "
              f"{whole_at} ...]\n")
    text = head.decode("utf-8", "replace") + marker + tail.decode("utf-8", "replace")
    return Capped(text, len(data), len(middle), lines)
