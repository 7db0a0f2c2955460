"""A sandbox's bytes on a terminal (terminal.py): every control character but newline and
tab shown as an escape, a character split between chunks kept whole; raw through a pipe
and with --raw. A real pty, no daemon."""

from __future__ import annotations

import io
import os

import pytest

from sandboxd_client.cli_common import fail, shown
from sandboxd_client.terminal import Sink, VisibleBytes, on_terminal, sink, visible


@pytest.mark.parametrize("raw, shown", [
    ("+curl x | sh\x1b[1A\x1b[2K", "+curl x | sh\\x1b[1A\\x1b[2K"),  # a line erased
    ("evil\rgood", "evil\\rgood"),  # a line overwritten
    ("ab\x08\x08xy", "ab\\x08\\x08xy"),
    ("\x1b]52;c;Y3VybA==\x07", "\\x1b]52;c;Y3VybA==\\x07"),  # the clipboard set
    ("del\x7f", "del\\x7f"),
    ("csi\x9b2J", "csi\\x9b2J"),  # a C1 control as a code point
    ("is_admin\u202e \u2066// check\u2069\u2066", "is_admin\\u202e \\u2066// check\\u2069\\u2066"),
    ("line\n\tindented ünïcode ✓\n", "line\n\tindented ünïcode ✓\n"),  # kept
])
def test_control_characters_are_shown_as_escapes(raw, shown):
    assert visible(raw) == shown


def test_bytes_are_made_visible_across_chunks():
    v = VisibleBytes()
    out = v.feed(b"ok \xe2\x9c") + v.feed(b"\x93 \x1b") + v.feed(b"[2K \xc2") + v.feed(b"\x9b and \xff") + \
        v.feed(b"\xe2", final=True)
    assert out == "ok ✓ \\x1b[2K \\x9b and \\xff\\xe2".encode()


def test_a_pty_is_a_terminal_a_pipe_is_not_and_raw_wins():
    master, slave = os.openpty()
    r, w = os.pipe()
    try:
        with open(slave, "w", closefd=False) as tty, open(w, "w", closefd=False) as pipe:
            assert on_terminal(tty) and not on_terminal(tty, raw=True) and not on_terminal(pipe)
            out = sink(tty)
            out.write(b"a\x1b[1Ab\r\n")
            out.close()
            piped = sink(pipe)
            piped.write(b"a\x1b[1Ab\r\n")
            piped.close()
        assert os.read(master, 100).replace(b"\r\n", b"\n") == b"a\\x1b[1Ab\\r\n"
        assert os.read(r, 100) == b"a\x1b[1Ab\r\n"
    finally:
        for fd in (master, slave, r, w):
            os.close(fd)


def test_a_sink_holds_a_split_character_until_it_is_whole_or_closed():
    buf = io.BytesIO()
    s = Sink(buf, escape=True)
    assert s.write(b"\xe2\x9c") == 2 and buf.getvalue() == b""
    s.close()
    assert buf.getvalue() == b"\\xe2\\x9c"


def test_a_table_cell_escapes_c1_controls_del_and_bidi_too():
    # JSON's escapes stop at U+001F: a C1 CSI, DEL or a bidi override went through.
    assert shown("a\x1b[2J\x9b2J\x7f\u202eb\nc") == "a\\u001b[2J\\x9b2J\\x7f\\u202eb\\nc"


def test_a_refusal_echoing_a_sandbox_path_shows_its_escapes(capsys):
    assert fail("NOT_FOUND: path: /workspace/a\x1b[2K\rok", 1) == 1
    assert capsys.readouterr().err == "sandboxctl: NOT_FOUND: path: /workspace/a\\x1b[2K\\rok\n"
