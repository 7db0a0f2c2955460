"""The pure parts of sandboxd.backends.docker.backend: create/host-config arguments, the
attach stream's frame parser and signal names. No dockerd involved."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from sandboxd.core import assets
from sandboxd.core.errors import FailedPrecondition
from sandboxd.sandbox.protocol import SandboxHandle
from sandboxd.backends.docker.backend import (
    check_image_env,
    create_args,
    host_config_args,
    load_seccomp_profile,
    make_stdio_fifos,
    open_stdio_fifos,
    parse_frames,
    pump_fifos,
    remove_stdio_fifos,
)
from sandboxd.backends.docker.compile import compile_docker
from sandboxd.sandbox.signals import signal_name
from sandboxd.sandbox.spec import SandboxIdentity
from sandboxd.core.errors import BackendUnavailable
from sandboxd.sandbox.output import STDERR, STDOUT, OutputSpool
from sandboxd.policy.preflight import Bind, HostPlan, Mask

from .conftest import resolve

SECCOMP = json.dumps({"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ALLOW"}]})
WS = "/srv/sandboxd/workspaces/bob"


@pytest.fixture
def spec():
    policy = resolve({
        "filesystem": {"readRoots": ["/workspace/src"], "writeRoots": ["/workspace/out"],
                       "blockedPaths": ["/workspace/src/.env", "/workspace/src/keys"]},
        "environment": {"injectedEnv": {"A": "1"}},
        "process": {"maxMemoryMb": 256, "maxPids": 32, "cpuMillicores": 1500, "maxFileSizeMb": 8, "maxTmpSizeMb": 16},
    })
    plan = HostPlan(WS, 1000, 1000,
                    binds=(Bind("/workspace/src", f"{WS}/src", True), Bind("/workspace/out", f"{WS}/out", False)),
                    masks=(Mask("/workspace/src/.env", "file"), Mask("/workspace/src/keys", "dir")))
    return compile_docker(policy, plan, SandboxIdentity("d1", "sbx-1", "tc-1"), argv=("cat", "-"),
                          image="sandboxd/default:latest", stdin_open=True, mask_file="/state/mask",
                          seccomp_profile="p.json")


# ------------------------------------------------------------------ create_args


def test_create_args(spec):
    args = create_args(spec)
    assert args == {
        "image": "sandboxd/default:latest",
        "entrypoint": [""],  # the image's own would run before the shim
        "command": ["cat", "-"],
        "user": "1000:1000",
        "working_dir": "/workspace",
        "environment": spec.env,
        "labels": spec.labels,
        "name": "sandboxd-sbx-1",
        "hostname": "sandbox",
        "stdin_open": True,
        "tty": False,
    }
    assert args["environment"] is not spec.env  # a copy: the SDK may mutate it


def test_create_args_has_no_shell_wrapping(spec):
    assert create_args(spec)["command"] == list(spec.argv)


def test_an_image_env_of_only_what_every_call_sets_is_accepted():
    check_image_env("sandboxd/default", ["PATH=/bin", "LANG=C.UTF-8", "HOME=/root", "TMPDIR=/var/tmp"])
    check_image_env("scratch", [])


def test_an_image_env_that_would_reach_the_sandbox_is_refused_naming_it():
    with pytest.raises(FailedPrecondition) as exc:
        check_image_env("evil:1", ["PATH=/bin", "LD_PRELOAD=/x.so", "A="])
    assert exc.value.field == "runtime.image"
    assert "'evil:1' sets A, LD_PRELOAD" in str(exc.value)


# ------------------------------------------------------------------ host_config_args


def test_host_config_security(spec):
    hc = host_config_args(spec, SECCOMP)
    assert hc["cap_drop"] == ["ALL"]
    assert hc["read_only"] is True
    assert hc["init"] is True
    assert "no-new-privileges:true" in hc["security_opt"]
    [seccomp] = [o for o in hc["security_opt"] if o.startswith("seccomp=")]
    assert json.loads(seccomp.removeprefix("seccomp=")) == json.loads(SECCOMP)
    assert hc["ipc_mode"] == "private"
    assert hc["network_mode"] == "none"
    assert "privileged" not in hc and "cap_add" not in hc


def test_host_config_no_privileges_flag_follows_spec(spec):
    from dataclasses import replace
    hc = host_config_args(replace(spec, no_new_privileges=False), SECCOMP)
    assert hc["security_opt"] == [f"seccomp={SECCOMP}"]


def test_host_config_logging_off(spec):
    assert host_config_args(spec, SECCOMP)["log_config"] == {"Type": "none", "Config": {}}


def test_host_config_resources(spec):
    hc = host_config_args(spec, SECCOMP)
    assert hc["mem_limit"] == 256 * 2**20
    assert hc["memswap_limit"] == hc["mem_limit"]
    assert hc["pids_limit"] == 32
    assert hc["nano_cpus"] == 1_500_000_000
    assert hc["cgroup_parent"] == "/sandboxd/sbx-1"
    assert hc["ulimits"] == [
        {"Name": "fsize", "Soft": 8 * 2**20, "Hard": 8 * 2**20},
        {"Name": "nofile", "Soft": 4096, "Hard": 4096},
        {"Name": "core", "Soft": 0, "Hard": 0},
    ]


def test_host_config_mounts_in_docker_api_shape(spec):
    mounts = host_config_args(spec, SECCOMP)["mounts"]
    by_target = {m["Target"]: m for m in mounts}
    assert [m["Target"] for m in mounts] == [m.target for m in spec.mounts]
    assert by_target["/workspace"] == {"Type": "tmpfs", "Target": "/workspace", "ReadOnly": False,
                                       "TmpfsOptions": {"SizeBytes": 64 * 1024, "Mode": 0o755}}
    assert by_target["/tmp"] == {"Type": "tmpfs", "Target": "/tmp", "ReadOnly": False,
                                 "TmpfsOptions": {"SizeBytes": 16 * 2**20, "Mode": 0o1777}}
    assert by_target["/workspace/src"] == {"Type": "bind", "Target": "/workspace/src", "ReadOnly": True,
                                           "Source": f"{WS}/src", "BindOptions": {"Propagation": "rprivate"}}
    assert by_target["/workspace/out"]["ReadOnly"] is False
    assert by_target["/workspace/out"]["Source"] == f"{WS}/out"
    assert by_target["/workspace/src/.env"] == {"Type": "bind", "Target": "/workspace/src/.env", "ReadOnly": True,
                                                "Source": "/state/mask", "BindOptions": {"Propagation": "rprivate"}}
    assert by_target["/workspace/src/keys"]["Type"] == "tmpfs"
    assert by_target["/workspace/src/keys"]["ReadOnly"] is True
    for m in mounts:
        if m["Type"] == "tmpfs":
            assert "Source" not in m and "BindOptions" not in m
        else:
            assert "TmpfsOptions" not in m


def test_host_config_is_json_serializable(spec):
    json.dumps(host_config_args(spec, SECCOMP))
    json.dumps(create_args(spec))


# ------------------------------------------------------------------ parse_frames


def frame(stream: int, data: bytes) -> bytes:
    return struct.pack(">BxxxI", stream, len(data)) + data


FRAMES = [
    (1, b"hello "),
    (2, b"warning: x\n"),
    (1, b""),
    (1, b"world\n"),
    (2, bytes(range(256))),
    (0, b"stdin-echo"),  # stream 0 is routed to stdout, as Docker's stdcopy does
    (1, b"\x00\x01\x02 end"),
]
WIRE = b"".join(frame(s, d) for s, d in FRAMES)
WANT_OUT = b"".join(d for s, d in FRAMES if s != 2)
WANT_ERR = b"".join(d for s, d in FRAMES if s == 2)
FRAME_ENDS = []
_pos = 0
for _s, _d in FRAMES:
    _pos += 8 + len(_d)
    FRAME_ENDS.append(_pos)


def new_spool(path) -> OutputSpool:
    return OutputSpool(path, {STDOUT: 1 << 20, STDERR: 1 << 20}, preview_bytes=64)


def stored(spool: OutputSpool, stream: int) -> bytes:
    return spool.summary(stream).path.read_bytes()


def test_parse_whole_buffer(tmp_path):
    spool = new_spool(tmp_path)
    assert parse_frames(WIRE, spool) == len(WIRE)
    spool.close()
    assert stored(spool, STDOUT) == WANT_OUT
    assert stored(spool, STDERR) == WANT_ERR


def test_parse_empty_and_short_headers(tmp_path):
    spool = new_spool(tmp_path)
    assert parse_frames(b"", spool) == 0
    for n in range(1, 8):
        assert parse_frames(WIRE[:n], spool) == 0
    spool.close()
    assert spool.summary(STDOUT).produced_bytes == 0


def test_consumed_count_is_end_of_last_complete_frame(tmp_path):
    for cut in range(len(WIRE) + 1):
        want = max([0] + [e for e in FRAME_ENDS if e <= cut])
        spool = new_spool(tmp_path / f"c{cut}")
        assert parse_frames(WIRE[:cut], spool) == want, cut
        spool.close()
        # Exactly the complete frames were written, nothing of the partial one.
        done = [d for (s, d), e in zip(FRAMES, FRAME_ENDS) if e <= cut]
        assert spool.summary(STDOUT).produced_bytes + spool.summary(STDERR).produced_bytes == sum(map(len, done)), cut
        spool.discard()


def test_frames_split_at_every_boundary(tmp_path):
    """Two reads, split at every possible byte, fed the way the pump feeds them."""
    for cut in range(len(WIRE) + 1):
        spool = new_spool(tmp_path / f"s{cut}")
        pending = b""
        for data in (WIRE[:cut], WIRE[cut:]):
            buf = pending + data
            used = parse_frames(buf, spool)
            pending = buf[used:]
        spool.close()
        assert pending == b"", cut
        assert stored(spool, STDOUT) == WANT_OUT, cut
        assert stored(spool, STDERR) == WANT_ERR, cut
        spool.discard()


def test_frames_split_into_three_reads(tmp_path):
    """Every pair of cut points inside the first frames (header and payload split)."""
    n = FRAME_ENDS[1] + 2
    for a in range(n):
        for b in range(a, n):
            spool = new_spool(tmp_path / f"t{a}-{b}")
            pending = b""
            for data in (WIRE[:a], WIRE[a:b], WIRE[b:]):
                buf = pending + data
                pending = buf[parse_frames(buf, spool):]
            spool.close()
            assert (pending, stored(spool, STDOUT), stored(spool, STDERR)) == (b"", WANT_OUT, WANT_ERR), (a, b)
            spool.discard()


def test_frames_fed_one_byte_at_a_time(tmp_path):
    spool = new_spool(tmp_path)
    pending = b""
    for i in range(len(WIRE)):
        buf = pending + WIRE[i:i + 1]
        pending = buf[parse_frames(buf, spool):]
    spool.close()
    assert pending == b""
    assert stored(spool, STDOUT) == WANT_OUT
    assert stored(spool, STDERR) == WANT_ERR


def test_large_frame_size_field_is_big_endian(tmp_path):
    spool = new_spool(tmp_path)
    payload = b"x" * 70_000  # needs more than the low byte of the size
    wire = frame(1, payload)
    assert parse_frames(wire[:-1], spool) == 0
    assert parse_frames(wire, spool) == len(wire)
    spool.close()
    assert stored(spool, STDOUT) == payload


def test_parse_frames_respects_spool_caps(tmp_path):
    spool = OutputSpool(tmp_path, {STDOUT: 5, STDERR: 100}, preview_bytes=64)
    assert parse_frames(WIRE, spool) == len(WIRE)
    spool.close()
    assert stored(spool, STDOUT) == WANT_OUT[:5]
    s = spool.summary(STDOUT)
    assert s.truncated and s.produced_bytes == len(WANT_OUT)


# ------------------------------------------------------------------ signals


@pytest.mark.parametrize("code, name", [
    (137, "SIGKILL"), (143, "SIGTERM"), (129, "SIGHUP"), (130, "SIGINT"), (139, "SIGSEGV"), (134, "SIGABRT"),
    (0, ""), (1, ""), (127, ""), (128, ""), (255, ""), (-1, ""), (128 + 65, ""),
])
def test_signal_name(code, name):
    assert signal_name(code) == name


@pytest.mark.parametrize("code, name", [(128 + 32, "SIG32"), (128 + 35, "SIG35"), (128 + 34, "SIGRTMIN"),
                                        (128 + 64, "SIGRTMAX")])
def test_signal_name_unnamed_and_realtime_signals(code, name):
    assert signal_name(code) == name


# ------------------------------------------------------------------ seccomp profile


def test_load_seccomp_profile(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(SECCOMP)
    assert load_seccomp_profile(str(p)) == SECCOMP


@pytest.mark.parametrize("content", [None, "{not json"])
def test_load_seccomp_profile_refuses_missing_or_broken(tmp_path, content):
    p = tmp_path / "p.json"
    if content is not None:
        p.write_text(content)
    with pytest.raises(BackendUnavailable):
        load_seccomp_profile(str(p))


@pytest.mark.parametrize("stream, offset, size", [(1, 0, 0), (2, 0, 5), (1, 127, 128), (2, 2**40, 300_000), (1, 1, 1)])
def test_pre_encoded_output_events_parse_as_the_proto_message(stream, offset, size):
    from sandboxd.api.messages import encode_output_event
    from sandboxd_contract.pb import sandboxd_pb2 as pb

    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    event = pb.ExecuteEvent.FromString(encode_output_event("tc-é1", stream, offset, data))
    assert event.tool_call_id == "tc-é1" and event.WhichOneof("kind") == "output"
    assert event.output.stream == (pb.OUTPUT_STREAM_STDOUT if stream == 1 else pb.OUTPUT_STREAM_STDERR)
    assert event.output.offset == offset and event.output.data == data
    want = pb.ExecuteEvent(tool_call_id="tc-é1", output=pb.OutputChunk(stream=event.output.stream, offset=offset, data=data))
    assert encode_output_event("tc-é1", stream, offset, data) == want.SerializeToString()


@pytest.mark.parametrize("effects", [
    None,
    {"reads": [], "writes": [], "deletes": [], "externalCalls": []},
    {"reads": [f"/workspace/m{i}.py" for i in range(1000)], "writes": ["/workspace/out é.txt"],
     "deletes": ["/workspace/gone"], "incomplete": ["the kernel's event queue overflowed"],
     "externalCalls": ["pypi.test:443"]},
])
def test_results_encode_as_parse_dict_encodes_them(effects):
    from google.protobuf import json_format

    from sandboxd.api.messages import result_to_pb
    from sandboxd_contract.pb import sandboxd_pb2 as pb

    result = {"toolCallId": "tc_1", "status": "error", "exitCode": 3, "signal": "", "timedOut": False,
              "stdoutPreview": "x", "artifacts": [{"artifactId": "art_1", "kind": "stdout", "sizeBytes": 5}],
              "usage": {"latencyMs": 12, "cpuMs": 3}, "provenance": {"eventId": "ev_1", "artifactRefs": ["art_1"]},
              "error": {"code": "NONZERO_EXIT", "message": "m", "retryable": False, "safeToShowUser": True}}
    if effects is not None:
        result["effectsObserved"] = effects
    want = json_format.ParseDict(result, pb.ToolResult())
    assert result_to_pb(result) == want
    assert result_to_pb(result).SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)


def test_a_result_field_the_contract_lacks_is_an_error_not_dropped():
    from google.protobuf import json_format

    from sandboxd.api.messages import result_to_pb

    with pytest.raises(json_format.ParseError, match="noSuchField"):
        result_to_pb({"toolCallId": "tc_1", "usage": {"latencyMs": 1, "noSuchField": 2}})


# ------------------------------------------------------------------ output FIFOs


def _fifo_pump(tmp_path, uid=os.getuid(), gid=os.getgid(), grace_s=5.0, sink=None):
    """make + open the FIFOs and start pump_fifos, as create() and start() do."""
    directory = str(tmp_path / "stdio" / "sbx-1")
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    make_stdio_fifos(directory, uid, gid)
    spool = sink or OutputSpool(tmp_path / "spool", {STDOUT: 1 << 30, STDERR: 1 << 30}, preview_bytes=8)
    fifos = open_stdio_fifos(directory)
    wake_r, wake_w = os.pipe2(os.O_CLOEXEC)
    handle = SandboxHandle("sbx-1", "c1", None)
    thread = threading.Thread(target=pump_fifos, args=(fifos, wake_r, spool, handle, grace_s), daemon=True)
    thread.start()
    return directory, spool, handle, thread, wake_w


def _writer(directory: str, script: str) -> subprocess.Popen:
    """A process standing in for the shim: its stdout and stderr are the FIFOs."""
    out = os.open(f"{directory}/stdout", os.O_WRONLY)
    err = os.open(f"{directory}/stderr", os.O_WRONLY)
    try:
        return subprocess.Popen(["/bin/sh", "-c", script], stdout=out, stderr=err)
    finally:
        os.close(out)
        os.close(err)


def test_stdio_fifos_are_write_only_for_the_sandbox_user(tmp_path):
    directory = str(tmp_path / "sbx-1")
    make_stdio_fifos(directory, 12345, 23456)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o711
    for name in ("stdout", "stderr"):
        st = os.stat(f"{directory}/{name}")
        assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o200
        assert (st.st_uid, st.st_gid) == (12345, 23456)
    make_stdio_fifos(directory, 12345, 23456)  # a leftover of the same name is replaced
    remove_stdio_fifos(directory)
    assert not os.path.exists(directory)


def test_fifo_pump_reads_both_streams_and_ends_after_the_container(tmp_path):
    directory, spool, handle, thread, wake_w = _fifo_pump(tmp_path)
    _writer(directory, "head -c 3000000 /dev/zero; echo err >&2").wait()
    # The writers are gone, but output stays open until the container has ended too.
    assert not handle.output_closed.wait(0.3)
    os.close(wake_w)
    assert handle.output_closed.wait(5)
    thread.join(5)
    spool.close()
    assert spool.summary(STDOUT).stored_bytes == 3_000_000
    assert spool.summary(STDOUT).content_hash == "sha256:" + hashlib.sha256(b"\0" * 3_000_000).hexdigest()
    assert (tmp_path / "spool" / "stderr.out").read_bytes() == b"err\n"


def test_fifo_pump_ends_when_the_container_ended_before_anything_opened_them(tmp_path):
    _, spool, handle, thread, wake_w = _fifo_pump(tmp_path, grace_s=0.2)
    assert not handle.output_closed.wait(0.2)
    os.close(wake_w)  # e.g. the container died before its shim ran
    assert handle.output_closed.wait(5)
    thread.join(5)
    assert not thread.is_alive()
    assert spool.summary(STDOUT).produced_bytes == 0


def test_fifo_pump_waits_for_a_writer_still_dying_after_the_container_ended(tmp_path):
    directory, spool, handle, thread, wake_w = _fifo_pump(tmp_path)
    proc = _writer(directory, "echo one; sleep 0.5; echo two")
    time.sleep(0.1)
    os.close(wake_w)
    assert not handle.output_closed.wait(0.2), "a process still holds the pipe: its last bytes must land"
    proc.wait()
    assert handle.output_closed.wait(5)
    spool.close()
    assert (tmp_path / "spool" / "stdout.out").read_bytes() == b"one\ntwo\n"


def test_fifo_pump_does_not_end_a_stream_before_its_writer_came(tmp_path):
    # A FIFO read returns 0 while no writer has opened it: that is not the end.
    directory, spool, handle, thread, wake_w = _fifo_pump(tmp_path)
    time.sleep(0.3)
    _writer(directory, "echo late").wait()
    os.close(wake_w)
    assert handle.output_closed.wait(5)
    spool.close()
    assert (tmp_path / "spool" / "stdout.out").read_bytes() == b"late\n"


def test_fifo_pump_does_not_wait_on_a_writer_outside_the_container(tmp_path):
    # A host process of the sandbox's uid can hold the command's stdout (through
    # /proc/<pid>/fd): once the container has ended, the call does not wait on it.
    directory, spool, handle, thread, wake_w = _fifo_pump(tmp_path, grace_s=0.3)
    holder = _writer(directory, "echo before; exec sleep 30")
    try:
        time.sleep(0.2)
        start = time.monotonic()
        os.close(wake_w)
        assert handle.output_closed.wait(5)
        assert 0.25 < time.monotonic() - start < 3
        thread.join(5)
        assert not thread.is_alive()
        spool.close()
        assert (tmp_path / "spool" / "stdout.out").read_bytes() == b"before\n"
    finally:
        holder.kill()
        holder.wait()


def test_fifo_pump_keeps_reading_when_the_output_cannot_be_stored(tmp_path):
    class FullDisk:
        def write(self, stream, data):
            raise OSError(28, "No space left on device")

    directory, _, handle, thread, wake_w = _fifo_pump(tmp_path, sink=FullDisk())
    writer = _writer(directory, "head -c 3000000 /dev/zero")
    # Far more than a pipe holds: the command finishes only if the pump reads on.
    assert writer.wait(10) == 0
    os.close(wake_w)
    assert handle.output_closed.wait(5)


def test_the_shim_hands_the_command_the_fifos_even_with_stdio_closed(tmp_path):
    shim = assets.packaged(assets.SHIM)
    directory = str(tmp_path / "sbx-1")
    make_stdio_fifos(directory, os.getuid(), os.getgid())
    fifos = open_stdio_fifos(directory)
    try:
        # The shim starts with fds 1 and 2 closed: its opens land on them.
        proc = subprocess.run(["/bin/sh", "-c", f'exec 1>&- 2>&-; exec {shim} --stdio {directory} -- '
                               '/bin/sh -c "echo out; echo err >&2; ls -l /proc/self/fd/ >/dev/null"'],
                              timeout=10)
        assert proc.returncode == 0
        got = {stream: os.read(fd, 100) for stream, fd in fifos.items()}
        assert got == {STDOUT: b"out\n", STDERR: b"err\n"}
    finally:
        for fd in fifos.values():
            os.close(fd)


def test_a_removal_dockerd_does_not_answer_is_retried_until_it_does_or_given_up():
    import threading

    import requests

    from sandboxd.backends.docker.backend import DockerBackend

    class Engine:
        """dockerd down for a while (refused connections), then up; one container never goes."""
        def __init__(self):
            self.down = True
            self.removed = []

        def remove_container(self, ref, force, v):
            if self.down:
                raise requests.exceptions.ConnectionError("refused")
            if ref == "stuck":
                raise requests.exceptions.ConnectionError("still refused for this one")
            self.removed.append(ref)

    backend = object.__new__(DockerBackend)  # the retry's bookkeeping alone (tested with dockerd itself too)
    backend.removal_retry_s, backend.removal_give_up_s = 0.01, 0.3
    backend._api, backend._errors = Engine(), __import__("docker").errors
    backend._pending_lock, backend._pending_removals, backend._remover = threading.Lock(), {}, None
    assert not backend._force_remove("c1")
    backend._remove_later("c1")
    backend._remove_later("stuck")
    time.sleep(0.1)
    assert backend.pending_removals() == 2 and backend._api.removed == []
    backend._api.down = False
    deadline = time.monotonic() + 5
    while backend.pending_removals() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend._api.removed == ["c1"] and backend.pending_removals() == 0, "c1 removed, 'stuck' given up"
    assert backend._remover is None


def test_a_sandbox_dockerd_refuses_is_unwound_whole_and_said_as_the_daemons_error(spec, tmp_path):
    """create()'s cleanup stack: the output FIFOs it made go, the container (made even
    if dockerd's answer is lost) is removed by name, and dockerd's refusal arrives as
    InternalError, never as the SDK's APIError."""
    import threading
    from dataclasses import replace

    import docker

    from sandboxd.backends.docker.backend import DockerBackend
    from sandboxd.core.errors import InternalError

    class Engine:
        def __init__(self):
            self.removed = []

        def create_host_config(self, **kwargs):
            return kwargs

        def create_container(self, **kwargs):
            raise docker.errors.APIError("500 Server Error", explanation="unknown runtime")

        def remove_container(self, ref, force, v):
            self.removed.append(ref)

    backend = object.__new__(DockerBackend)  # the unwinding alone (a real refusal: test_execute's)
    backend._api, backend._seccomp_json = Engine(), SECCOMP
    backend._pending_lock, backend._pending_removals, backend._remover = threading.Lock(), {}, None
    stdio = tmp_path / "sbx-1"
    spec = replace(spec, stdio_host_dir=str(stdio), staging=None)
    with pytest.raises(InternalError, match="dockerd failed to create the sandbox: unknown runtime"):
        backend.create(spec)
    assert backend._api.removed == [spec.name]
    assert not stdio.exists(), "the FIFOs made for it were left behind"
    assert backend.pending_removals() == 0


def test_dockerds_errors_reach_callers_only_as_the_daemons():
    import docker
    import requests

    from sandboxd.backends.docker.errors import EngineRefused, dockerd
    from sandboxd.core.errors import FailedPrecondition, InternalError

    with pytest.raises(BackendUnavailable, match="dockerd did not answer: ConnectionError"):
        with dockerd("list containers"):
            raise requests.exceptions.ConnectionError("refused")
    with pytest.raises(FailedPrecondition, match="'img:1' is not present in the local engine"):
        with dockerd("inspect 'img:1'", image="img:1"):
            raise docker.errors.ImageNotFound("404 Client Error")
    with pytest.raises(InternalError, match="dockerd failed to start the sandbox: busy"):
        with dockerd("start the sandbox"):
            raise docker.errors.APIError("500", explanation="busy")
    with pytest.raises(EngineRefused) as refused:
        with dockerd("remove a container", refusal=None):
            raise docker.errors.NotFound("404 Client Error", explanation="no such container")
    assert refused.value.explanation == "no such container"

