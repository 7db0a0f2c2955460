"""sandboxd-mcp's output cap (pure): output within the budget is whole; longer output
keeps its head and tail around a marker that says what was cut and where the whole is."""

from __future__ import annotations

import pytest

from sandboxd_client.mcp.capping import MIN_BUDGET_BYTES, cap_output

WHOLE = "the whole stdout is artifact art_1 (sandboxd://artifacts/art_1)"


def test_output_within_the_budget_is_whole_up_to_the_last_byte():
    data = b"x" * 1000
    exact = cap_output(data, 1000, stream="stdout", whole_at=WHOLE)
    assert exact.text == data.decode() and not exact.cut and exact.total_bytes == 1000
    over = cap_output(data + b"y", 1000, stream="stdout", whole_at=WHOLE)
    assert over.cut and over.cut_bytes > 0 and over.total_bytes == 1001


def test_long_output_keeps_head_and_tail_and_names_the_artifact():
    lines = [f"line {i:05d}".encode() for i in range(10_000)]
    data = b"\n".join(lines) + b"\n"
    capped = cap_output(data, 2000, stream="stdout", whole_at=WHOLE)
    assert capped.text.startswith("line 00000\nline 00001\n")
    assert capped.text.endswith("line 09999\n")
    assert "sandboxd-mcp cut" in capped.text and "sandboxd://artifacts/art_1" in capped.text
    assert f"cut {capped.cut_bytes} bytes" in capped.text and "from the middle of stdout" in capped.text
    head, _, rest = capped.text.partition("\n[... ")
    _, _, tail = rest.partition(" ...]\n")
    # Cut at line boundaries: whole lines on both sides, and no more than the budget kept.
    assert all(line.startswith("line ") and len(line) == 10 for line in (head + "\n" + tail).split("\n") if line)
    assert len(head.encode()) + len(tail.encode()) + capped.cut_bytes == len(data)
    assert len(head.encode()) + len(tail.encode()) <= 2000
    assert capped.cut_lines == data[len(head):len(data) - len(tail)].count(b"\n")


def test_a_cut_never_splits_a_utf8_character():
    data = "é€😀".encode() * 500  # 2, 3 and 4 byte sequences
    for budget in range(MIN_BUDGET_BYTES, MIN_BUDGET_BYTES + 12):
        capped = cap_output(data, budget, stream="stdout", whole_at=WHOLE)
        assert "\ufffd" not in capped.text, budget


def test_binary_output_is_shown_with_replacement_characters():
    capped = cap_output(b"\xff\xfe" * 10, 1024, stream="stderr", whole_at=WHOLE)
    assert capped.text == "\ufffd" * 20 and not capped.cut


def test_a_budget_too_small_to_be_useful_is_refused():
    with pytest.raises(ValueError, match=str(MIN_BUDGET_BYTES)):
        cap_output(b"x", MIN_BUDGET_BYTES - 1, stream="stdout", whole_at=WHOLE)
    assert cap_output(b"x", MIN_BUDGET_BYTES, stream="stdout", whole_at=WHOLE).text == "x"
