"""sandboxd.sandbox.output.OutputSpool: caps, hashes, previews, following while written."""

from __future__ import annotations

import hashlib
import os
import threading
import time

from sandboxd.sandbox.output import MAX_CHUNK_BYTES, STDERR, STDOUT, OutputSpool


def spool_at(tmp_path, out_cap=1 << 20, err_cap=1 << 20, preview=16) -> OutputSpool:
    return OutputSpool(tmp_path / "spool", {STDOUT: out_cap, STDERR: err_cap}, preview_bytes=preview)


def collect(spool: OutputSpool, **kw) -> dict[int, bytes]:
    got = {STDOUT: bytearray(), STDERR: bytearray()}
    for stream, offset, data in spool.follow(**kw):
        assert offset == len(got[stream]), "offsets must be contiguous per stream"
        got[stream] += data
    return {s: bytes(b) for s, b in got.items()}


# ------------------------------------------------------------------ caps and summaries


def test_files_and_modes(tmp_path):
    spool = spool_at(tmp_path)
    d = tmp_path / "spool"
    assert (d / "stdout.out").exists() and (d / "stderr.out").exists()
    assert os.stat(d).st_mode & 0o777 == 0o700
    assert os.stat(d / "stdout.out").st_mode & 0o777 == 0o600
    spool.close()


def test_under_cap_everything_is_stored(tmp_path):
    spool = spool_at(tmp_path)
    spool.write(STDOUT, b"hello ")
    spool.write(STDOUT, memoryview(b"world"))
    spool.write(STDERR, b"oops")
    spool.close()
    out, err = spool.summary(STDOUT), spool.summary(STDERR)
    assert (out.produced_bytes, out.stored_bytes, out.truncated) == (11, 11, False)
    assert out.path.read_bytes() == b"hello world"
    assert (err.produced_bytes, err.stored_bytes, err.truncated) == (4, 4, False)
    assert err.path.read_bytes() == b"oops"


def test_cap_per_stream(tmp_path):
    spool = spool_at(tmp_path, out_cap=10, err_cap=3)
    spool.write(STDOUT, b"0123456")
    spool.write(STDOUT, b"789abc")  # crosses the cap
    spool.write(STDOUT, b"more")  # entirely past it
    spool.write(STDERR, b"ab")
    spool.close()
    out, err = spool.summary(STDOUT), spool.summary(STDERR)
    assert (out.produced_bytes, out.stored_bytes, out.truncated) == (17, 10, True)
    assert out.path.read_bytes() == b"0123456789"
    assert (err.produced_bytes, err.stored_bytes, err.truncated) == (2, 2, False)


def test_exactly_at_cap_is_not_truncated(tmp_path):
    spool = spool_at(tmp_path, out_cap=4)
    spool.write(STDOUT, b"abcd")
    spool.write(STDOUT, b"")
    assert not spool.summary(STDOUT).truncated
    spool.write(STDOUT, b"e")
    assert spool.summary(STDOUT).truncated
    spool.close()


def test_zero_cap_stores_nothing(tmp_path):
    spool = spool_at(tmp_path, out_cap=0)
    spool.write(STDOUT, b"abc")
    spool.close()
    s = spool.summary(STDOUT)
    assert (s.produced_bytes, s.stored_bytes, s.truncated) == (3, 0, True)
    assert s.path.read_bytes() == b""
    assert s.content_hash == "sha256:" + hashlib.sha256(b"").hexdigest()


def test_content_hash_is_sha256_of_stored_bytes(tmp_path):
    spool = spool_at(tmp_path, out_cap=1000)
    data = os.urandom(3000)
    for i in range(0, len(data), 77):
        spool.write(STDOUT, data[i:i + 77])
    spool.close()
    s = spool.summary(STDOUT)
    assert s.path.read_bytes() == data[:1000]
    assert s.content_hash == "sha256:" + hashlib.sha256(data[:1000]).hexdigest()
    assert s.content_hash == "sha256:" + hashlib.sha256(s.path.read_bytes()).hexdigest()


def test_empty_stream_summary(tmp_path):
    spool = spool_at(tmp_path)
    spool.close()
    s = spool.summary(STDERR)
    assert (s.produced_bytes, s.stored_bytes, s.truncated, s.preview) == (0, 0, False, "")
    assert s.content_hash == "sha256:" + hashlib.sha256(b"").hexdigest()


def test_preview_is_capped(tmp_path):
    spool = spool_at(tmp_path, preview=10)
    spool.write(STDOUT, b"01234")
    spool.write(STDOUT, b"56789abcdef")
    spool.write(STDOUT, b"ghij")
    spool.write(STDERR, b"short")
    spool.close()
    assert spool.summary(STDOUT).preview == "0123456789"
    assert spool.summary(STDERR).preview == "short"


def test_preview_never_exceeds_stored(tmp_path):
    spool = spool_at(tmp_path, out_cap=3, preview=10)
    spool.write(STDOUT, b"abcdef")
    spool.close()
    assert spool.summary(STDOUT).preview == "abc"


def test_preview_replaces_invalid_utf8(tmp_path):
    spool = spool_at(tmp_path, preview=4)
    spool.write(STDOUT, "aé✓".encode())  # 1 + 2 + 3 bytes: the 4-byte cut splits "✓"
    spool.close()
    assert spool.summary(STDOUT).preview == "aé\ufffd"


# ------------------------------------------------------------------ follow


def test_follow_after_close_yields_everything(tmp_path):
    spool = spool_at(tmp_path)
    spool.write(STDOUT, b"a" * 10)
    spool.write(STDERR, b"b" * 5)
    spool.write(STDOUT, b"c" * 3)
    spool.close()
    got = collect(spool)
    assert got == {STDOUT: b"a" * 10 + b"c" * 3, STDERR: b"b" * 5}


def test_follow_yields_only_stored_bytes(tmp_path):
    spool = spool_at(tmp_path, out_cap=4)
    spool.write(STDOUT, b"abcdefgh")
    spool.close()
    assert collect(spool)[STDOUT] == b"abcd"


def test_follow_chunks_are_bounded(tmp_path):
    spool = spool_at(tmp_path, out_cap=4 * MAX_CHUNK_BYTES)
    spool.write(STDOUT, b"x" * (2 * MAX_CHUNK_BYTES + 5))
    spool.close()
    chunks = list(spool.follow())
    assert [len(d) for _, _, d in chunks] == [MAX_CHUNK_BYTES, MAX_CHUNK_BYTES, 5]
    assert [o for _, o, _ in chunks] == [0, MAX_CHUNK_BYTES, 2 * MAX_CHUNK_BYTES]


def test_follow_of_empty_closed_spool_ends(tmp_path):
    spool = spool_at(tmp_path)
    spool.close()
    assert list(spool.follow()) == []


def test_follow_with_concurrent_writer(tmp_path):
    spool = spool_at(tmp_path, out_cap=1 << 24, err_cap=1 << 24)
    rng = [os.urandom(n) for n in (1, 100, 4096, 65536, 7, 300_000, 13)] * 5
    want = {STDOUT: bytearray(), STDERR: bytearray()}

    def writer():
        for i, block in enumerate(rng):
            stream = STDOUT if i % 3 else STDERR
            spool.write(stream, block)
            want[stream] += block
            if i % 4 == 0:
                time.sleep(0.002)
        spool.close()

    t = threading.Thread(target=writer)
    t.start()
    got = collect(spool, poll_s=0.01)
    t.join(5)
    assert not t.is_alive()
    assert got == {s: bytes(b) for s, b in want.items()}


def test_follow_sees_data_before_close(tmp_path):
    spool = spool_at(tmp_path)
    first = threading.Event()
    seen: list[bytes] = []

    def reader():
        for _, _, data in spool.follow(poll_s=0.01):
            seen.append(data)
            first.set()

    t = threading.Thread(target=reader)
    t.start()
    spool.write(STDOUT, b"early")
    assert first.wait(5), "a follower must get data while the spool is still open"
    assert seen == [b"early"]
    assert t.is_alive(), "and must keep following until close()"
    spool.write(STDOUT, b"late")
    spool.close()
    t.join(5)
    assert not t.is_alive()
    assert b"".join(seen) == b"earlylate"


def test_two_followers_get_the_same(tmp_path):
    spool = spool_at(tmp_path)
    results: list[dict] = []
    threads = [threading.Thread(target=lambda: results.append(collect(spool, poll_s=0.01))) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(50):
        spool.write(STDOUT if i % 2 else STDERR, bytes([i]) * 100)
    spool.close()
    for t in threads:
        t.join(5)
    assert len(results) == 2 and results[0] == results[1]
    assert len(results[0][STDOUT]) == len(results[0][STDERR]) == 2500


def test_should_stop_ends_an_idle_follow(tmp_path):
    spool = spool_at(tmp_path)
    spool.write(STDOUT, b"x")
    stop = threading.Event()
    got: list = []

    def reader():
        for item in spool.follow(should_stop=stop.is_set, poll_s=0.01):
            got.append(item)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.05)
    assert t.is_alive()
    stop.set()
    t.join(2)
    assert not t.is_alive(), "should_stop must end follow() although the spool is open"
    assert got == [(STDOUT, 0, b"x")]
    spool.close()


def test_should_stop_ends_follow_between_rounds(tmp_path):
    spool = spool_at(tmp_path)
    spool.write(STDOUT, b"a")
    spool.write(STDERR, b"b")
    items = list(spool.follow(should_stop=lambda: True, poll_s=0.01))
    # What was already there is delivered, then it stops without waiting for close().
    assert items == [(STDOUT, 0, b"a"), (STDERR, 0, b"b")]
    spool.close()


# ------------------------------------------------------------------ close and discard


def test_close_is_idempotent(tmp_path):
    spool = spool_at(tmp_path)
    spool.close()
    spool.close()


def test_discard_removes_files(tmp_path):
    spool = spool_at(tmp_path)
    spool.write(STDOUT, b"x")
    spool.discard()
    assert not (tmp_path / "spool").exists()
    spool.discard()  # idempotent


def test_discard_keeps_directory_with_foreign_files(tmp_path):
    spool = spool_at(tmp_path)
    (tmp_path / "spool" / "other").write_text("keep")
    spool.discard()
    assert not (tmp_path / "spool" / "stdout.out").exists()
    assert (tmp_path / "spool" / "other").read_text() == "keep"


def test_write_after_close_never_reaches_another_file(tmp_path):
    # The executor closes the spool in its `finally` even when the backend's pump
    # thread may still be writing (a sandbox that did not end after SIGKILL). The
    # spool's file descriptors are then free for the next open() in the daemon, and
    # a late write() must not land in that unrelated file.
    spool = spool_at(tmp_path)
    spool.close()
    victims = [tmp_path / f"victim{i}" for i in range(8)]
    fds = [os.open(v, os.O_WRONLY | os.O_CREAT, 0o600) for v in victims]
    try:
        for stream in (STDOUT, STDERR):
            try:
                spool.write(stream, b"LEAKED")
            except Exception:
                pass  # refusing a late write is fine; writing it elsewhere is not
    finally:
        for fd in fds:
            os.close(fd)
    assert [v.read_bytes() for v in victims] == [b""] * len(victims)


def test_write_parts_keeps_order_caps_and_hash_across_many_small_parts(tmp_path):
    import hashlib

    from sandboxd.sandbox.output import IOV_MAX, STDERR, STDOUT, OutputSpool

    parts = [f"{i}\n".encode() for i in range(IOV_MAX * 3 + 7)]  # more than one writev's worth
    whole = b"".join(parts)
    cap = len(whole) - 5
    spool = OutputSpool(tmp_path / "s", {STDOUT: cap, STDERR: 10}, 16)
    spool.write_parts(STDOUT, [memoryview(p) for p in parts])
    spool.close()
    summary = spool.summary(STDOUT)
    assert summary.path.read_bytes() == whole[:cap]
    assert summary.truncated and summary.produced_bytes == len(whole) and summary.stored_bytes == cap
    assert summary.content_hash == "sha256:" + hashlib.sha256(whole[:cap]).hexdigest()
    assert summary.preview == whole[:16].decode()


def test_a_live_reader_gets_what_was_stored_even_from_a_reused_buffer(tmp_path):
    spool = spool_at(tmp_path)
    buf = bytearray(b"first")
    spool.write(STDOUT, memoryview(buf))
    buf[:] = b"XXXXX"  # the writer reuses its buffer (the pumps do): what was stored stays
    spool.write(STDOUT, b"second")
    spool.close()
    assert collect(spool)[STDOUT] == b"firstsecond"


def test_a_reader_following_a_writer_sees_every_byte_in_order(tmp_path):
    spool = spool_at(tmp_path, out_cap=1 << 30)
    blobs = [os.urandom(100_000 + i) for i in range(120)]

    def produce():
        for blob in blobs:
            spool.write(STDOUT, blob)
        spool.close()

    writer = threading.Thread(target=produce)
    writer.start()
    got = collect(spool)[STDOUT]
    writer.join()
    assert got == b"".join(blobs)


def test_many_small_writes_are_read_back_in_large_chunks(tmp_path):
    # A command printing a line at a time must not make the live stream crawl.
    spool = spool_at(tmp_path, out_cap=1 << 30)
    for i in range(50_000):
        spool.write(STDOUT, b"line %06d\n" % i)
    spool.close()
    chunks = [data for _, _, data in spool.follow()]
    assert len(chunks) <= 2 and b"".join(chunks) == b"".join(b"line %06d\n" % i for i in range(50_000))
