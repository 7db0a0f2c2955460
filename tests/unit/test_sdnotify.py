"""The sd_notify protocol as the daemon speaks it (core/sdnotify.py), over real datagram
sockets, and the systemd unit that relies on it (deploy/systemd/sandboxd.service)."""

from __future__ import annotations

import configparser
import inspect
import logging
import os
import shlex
import socket
import time
import uuid
from pathlib import Path

import pytest

from sandboxd import main as daemon_main
from sandboxd.core import sdnotify
from sandboxd.core.sdnotify import NOTIFY_SOCKET_ENV, SystemdNotifier, message, socket_address
from sandboxd.core.settings import DaemonSettings
from sandboxd.pools.manager import PoolManager

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "sandboxd.service"


@pytest.fixture
def receiver(tmp_path):
    """A datagram socket bound where systemd's would be: (its NOTIFY_SOCKET value, socket)."""
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2.0)
    yield str(path), sock
    sock.close()


@pytest.fixture
def abstract_receiver():
    name = f"sandboxd-test-notify-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2.0)
    yield "@" + name, sock
    sock.close()


# -- addresses and messages ----------------------------------------------------------

def test_a_path_is_its_own_address_and_an_at_name_is_abstract():
    assert socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert socket_address("@sd-notify-42") == "\0sd-notify-42"


@pytest.mark.parametrize("value", ["run/systemd/notify", "@", "vsock:2:1234", "notify.sock"])
def test_an_address_systemd_would_not_give_is_refused_by_name(value):
    with pytest.raises(ValueError, match="neither an absolute path nor an abstract name"):
        socket_address(value)


def test_a_message_is_one_assignment_a_line_and_a_value_cannot_start_another():
    assert message({"READY": "1", "STATUS": "serving"}) == b"READY=1\nSTATUS=serving\n"
    assert message({"STATUS": "one\ntwo\r\nREADY=1"}) == b"STATUS=one two READY=1\n"


@pytest.mark.parametrize("key", ["", "ready", "READY=1", "STATUS\n", "A B"])
def test_a_field_name_that_is_not_one_is_refused(key):
    with pytest.raises(ValueError, match="not a notification field name"):
        message({key: "1"})


# -- the environment ------------------------------------------------------------------

def test_the_socket_is_taken_out_of_the_environment_it_was_read_from():
    environ = {NOTIFY_SOCKET_ENV: "/run/systemd/notify", "PATH": "/usr/bin"}
    notifier = SystemdNotifier.take_from_environment(environ)
    assert notifier.notify_socket == "/run/systemd/notify" and notifier.enabled
    assert environ == {"PATH": "/usr/bin"}


def test_by_default_the_process_environment_loses_it(monkeypatch, receiver):
    monkeypatch.setenv(NOTIFY_SOCKET_ENV, receiver[0])
    notifier = SystemdNotifier.take_from_environment()
    assert NOTIFY_SOCKET_ENV not in os.environ
    assert notifier.notify_socket == receiver[0]


def test_without_notify_socket_nothing_is_sent_and_nothing_fails(monkeypatch):
    monkeypatch.delenv(NOTIFY_SOCKET_ENV, raising=False)
    notifier = SystemdNotifier.take_from_environment()
    assert not notifier.enabled
    assert notifier.ready("x") is False and notifier.stopping() is False
    # An empty value is no socket either (systemd never sets one).
    assert not SystemdNotifier.take_from_environment({NOTIFY_SOCKET_ENV: ""}).enabled


def test_the_daemon_takes_it_before_it_reads_its_configuration(monkeypatch, tmp_path, receiver):
    """main() drops NOTIFY_SOCKET first thing: even a start refused for its configuration
    leaves nothing for a child to inherit."""
    monkeypatch.setenv(NOTIFY_SOCKET_ENV, receiver[0])
    bad = tmp_path / "bad.yaml"
    bad.write_text("socket_mod: 1\n")
    assert daemon_main.main(["--config", str(bad)]) == 2
    assert NOTIFY_SOCKET_ENV not in os.environ


# -- sending, for real ----------------------------------------------------------------

def test_ready_and_stopping_reach_a_path_socket(receiver):
    address, sock = receiver
    notifier = SystemdNotifier(address)
    assert notifier.ready("serving on /run/sandboxd/sandboxd.sock")
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving on /run/sandboxd/sandboxd.sock\n"
    assert notifier.stopping()
    assert sock.recv(4096) == b"STOPPING=1\n"
    assert notifier.status("draining")
    assert sock.recv(4096) == b"STATUS=draining\n"


def test_ready_reaches_an_abstract_socket(abstract_receiver):
    address, sock = abstract_receiver
    assert SystemdNotifier(address).ready()
    assert sock.recv(4096) == b"READY=1\n"


def test_a_socket_nobody_listens_on_is_logged_not_raised(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="sandboxd.sdnotify")
    notifier = SystemdNotifier(str(tmp_path / "gone.sock"))
    assert notifier.ready() is False
    assert "could not notify systemd" in caplog.text and "READY" in caplog.text


@pytest.mark.parametrize("value", ["relative.sock", "/" + "x" * 200])
def test_an_unusable_address_is_logged_not_raised(value, caplog):
    caplog.set_level(logging.ERROR, logger="sandboxd.sdnotify")
    assert SystemdNotifier(value).stopping() is False
    assert "could not notify systemd" in caplog.text


def test_a_receiver_that_never_reads_costs_at_most_the_send_timeout(receiver, monkeypatch, caplog):
    """A full queue blocks a datagram sender: the notice gives up after SEND_TIMEOUT_S
    rather than hold the daemon's start or stop."""
    address, _ = receiver
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    filler.setblocking(False)
    sent = 0
    try:
        while True:
            filler.sendto(b"x" * 1024, address)
            sent += 1
    except BlockingIOError:
        pass
    finally:
        filler.close()
    assert sent > 0
    monkeypatch.setattr(sdnotify, "SEND_TIMEOUT_S", 0.3)
    caplog.set_level(logging.ERROR, logger="sandboxd.sdnotify")
    began = time.monotonic()
    assert SystemdNotifier(address).ready() is False
    assert 0.25 <= time.monotonic() - began < 2.0
    assert "timed out" in caplog.text


# -- the unit -------------------------------------------------------------------------

def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True, delimiters=("=",),
                                       comment_prefixes=("#", ";"), empty_lines_in_values=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd's keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def seconds(value: str) -> float:
    units = {"ms": 0.001, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600}
    for suffix, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * factor
    return float(value)


def test_the_unit_is_a_notify_service_of_the_main_process_with_a_delegated_cgroup():
    service = unit()["Service"]
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert service["Delegate"] == "yes"
    assert service["Restart"] == "on-failure"
    assert "2" in service["RestartPreventExitStatus"].split()  # a configuration that does not load


def test_the_unit_stops_the_daemon_alone_with_a_signal_it_handles_and_waits_long_enough():
    service = unit()["Service"]
    assert service["KillMode"] == "mixed"
    # The daemon's orderly stop starts on SIGTERM or SIGINT (main.main).
    assert service["KillSignal"] in ("SIGTERM", "SIGINT")
    assert "signal.SIGTERM, signal.SIGINT" in inspect.getsource(daemon_main.main)
    pools_budget_s = inspect.signature(PoolManager.shutdown).parameters["timeout_s"].default
    assert seconds(service["TimeoutStopSec"]) > DaemonSettings().grace_period_s + pools_budget_s


def test_the_unit_comes_after_docker_without_requiring_it():
    section = unit()["Unit"]
    assert "docker.service" in section["After"].split()
    assert "docker.service" in section["Wants"].split()
    assert "Requires" not in section and "BindsTo" not in section


def test_the_unit_gives_enough_descriptors_and_no_tasks_cap():
    service = unit()["Service"]
    assert int(service["LimitNOFILE"].split(":")[-1]) >= 65536
    assert service["TasksMax"] == "infinity"


# What would break the daemon under systemd (the unit's comment says why for each).
BREAKING = ("ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateMounts", "ProtectControlGroups",
            "ProtectKernelTunables", "ProtectKernelModules", "ReadOnlyPaths", "InaccessiblePaths", "MountFlags",
            "NoNewPrivileges", "CapabilityBoundingSet", "SystemCallFilter", "User", "DynamicUser",
            "RestrictNamespaces", "OOMScoreAdjust", "RuntimeDirectory", "StateDirectory", "PrivateUsers")


def test_the_unit_sets_no_option_that_would_break_the_daemon():
    service = unit()["Service"]
    assert not [key for key in BREAKING if key in service]


def test_the_unit_starts_the_installed_daemon_with_options_it_has():
    argv = shlex.split(unit()["Service"]["ExecStart"])
    assert argv[0] == "/opt/sandboxd/bin/sandboxd"  # docs/INSTALL.md: python3 -m venv /opt/sandboxd
    args = daemon_main._parse_args(argv[1:])  # an unknown option exits (SystemExit) here
    assert args.command is None  # the daemon, not `check`
    assert args.config == "/etc/sandboxd/sandboxd.yaml"


def test_the_unit_installs_into_the_ordinary_boot():
    assert unit()["Install"]["WantedBy"] == "multi-user.target"
