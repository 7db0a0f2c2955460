"""sandboxd.core.settings: workspace roots that could expose the daemon are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sandboxd.core.settings import DOCKER_SOCKET, DaemonSettings, LimitSettings, load_settings


def make(tmp_path, **kw) -> DaemonSettings:
    kw.setdefault("state_dir", tmp_path / "state")
    kw.setdefault("socket_path", tmp_path / "run" / "sandboxd.sock")
    kw.setdefault("workspace_roots", (tmp_path / "roots",))
    return DaemonSettings(**kw)


def test_defaults_are_valid():
    s = DaemonSettings()
    assert s.workspace_roots == (Path("/home"), Path("/srv/sandboxd/workspaces"))
    assert s.root_workspace_uid is None
    assert s.inheritable_env == ("LANG", "LC_ALL", "TZ")
    assert s.db_path == Path("/var/lib/sandboxd/sandboxd.db")
    assert s.blob_dir == Path("/var/lib/sandboxd/blobs")
    assert s.spool_dir == Path("/var/lib/sandboxd/spool")


def test_good_settings(tmp_path):
    s = make(tmp_path)
    assert s.workspace_roots == (tmp_path / "roots",)


def test_relative_root_is_refused(tmp_path):
    with pytest.raises(ValueError, match="absolute"):
        make(tmp_path, workspace_roots=(Path("relative/roots"),))


def test_slash_root_is_refused(tmp_path):
    with pytest.raises(ValueError):
        make(tmp_path, workspace_roots=(Path("/"),))


@pytest.mark.parametrize("rel", ["", "state", "state/sub"])
def test_root_overlapping_state_dir_is_refused(tmp_path, rel):
    root = tmp_path / rel if rel else tmp_path
    with pytest.raises(ValueError, match="state dir"):
        make(tmp_path, workspace_roots=(root,))


def test_root_overlapping_state_dir_through_symlink(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "state")
    with pytest.raises(ValueError, match="state dir"):
        make(tmp_path, workspace_roots=(tmp_path / "alias",))


def test_root_containing_daemon_socket_is_refused(tmp_path):
    with pytest.raises(ValueError, match="sandboxd.sock"):
        make(tmp_path, workspace_roots=(tmp_path / "run",))


def test_root_containing_docker_socket_is_refused(tmp_path):
    with pytest.raises(ValueError, match="docker.sock"):
        make(tmp_path, workspace_roots=(DOCKER_SOCKET.resolve().parent,))


def test_root_reaching_docker_socket_through_symlink_is_refused(tmp_path):
    (tmp_path / "alias").symlink_to(DOCKER_SOCKET.resolve().parent)
    with pytest.raises(ValueError, match="docker.sock"):
        make(tmp_path, workspace_roots=(tmp_path / "alias",))


def test_sibling_paths_are_not_overlaps(tmp_path):
    # "state2" is not inside "state", "roots" is not the socket's "run".
    s = make(tmp_path, workspace_roots=(tmp_path / "state2", tmp_path / "runx"))
    assert len(s.workspace_roots) == 2


def test_one_bad_root_among_good_ones(tmp_path):
    with pytest.raises(ValueError):
        make(tmp_path, workspace_roots=(tmp_path / "roots", tmp_path / "state"))


def test_unknown_setting_is_refused(tmp_path):
    with pytest.raises(ValueError):
        make(tmp_path, workspace_root=(tmp_path / "roots",))


def test_settings_are_frozen(tmp_path):
    s = make(tmp_path)
    with pytest.raises(Exception):
        s.state_dir = Path("/")  # type: ignore[misc]


def test_limit_settings_refuse_unknown(tmp_path):
    with pytest.raises(ValueError):
        LimitSettings(max_timeout=5)


# ------------------------------------------------------------------ load_settings


def write_yaml(tmp_path, data) -> Path:
    p = tmp_path / "sandboxd.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_load_settings_without_file_is_defaults():
    assert load_settings() == DaemonSettings()


def test_load_settings_from_yaml(tmp_path):
    p = write_yaml(tmp_path, {
        "state_dir": str(tmp_path / "state"),
        "socket_path": str(tmp_path / "s.sock"),
        "workspace_roots": [str(tmp_path / "roots")],
        "root_workspace_uid": 1234,
        "allowed_images": ["sandboxd/*", "library/python:*"],
        "limits": {"default_timeout_ms": 5000, "max_pids": 99},
        "max_concurrent_calls": 4,
    })
    s = load_settings(p)
    assert s.state_dir == tmp_path / "state"
    assert s.workspace_roots == (tmp_path / "roots",)
    assert s.root_workspace_uid == 1234
    assert s.allowed_images == ("sandboxd/*", "library/python:*")
    assert s.limits.default_timeout_ms == 5000 and s.limits.max_pids == 99
    assert s.limits.default_memory_mb == LimitSettings().default_memory_mb
    assert s.max_concurrent_calls == 4


def test_load_settings_overrides_win_and_none_is_ignored(tmp_path):
    p = write_yaml(tmp_path, {"state_dir": str(tmp_path / "state"), "workspace_roots": [str(tmp_path / "roots")],
                              "log_level": "INFO", "socket_path": str(tmp_path / "a.sock")})
    s = load_settings(p, log_level="DEBUG", socket_path=str(tmp_path / "b.sock"), daemon_id=None)
    assert s.log_level == "DEBUG"
    assert s.socket_path == tmp_path / "b.sock"
    assert s.daemon_id is None


def test_load_settings_empty_file(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("")
    assert load_settings(p) == DaemonSettings()


def test_load_settings_non_mapping(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="mapping"):
        load_settings(p)


def test_load_settings_unknown_key(tmp_path):
    p = write_yaml(tmp_path, {"state_dir": str(tmp_path / "state"), "workspace_roots": [str(tmp_path / "r")],
                              "bogus": 1})
    with pytest.raises(ValueError):
        load_settings(p)


def test_load_settings_refuses_unsafe_root_from_file(tmp_path):
    p = write_yaml(tmp_path, {"state_dir": str(tmp_path / "state"), "workspace_roots": [str(tmp_path)]})
    with pytest.raises(ValueError, match="state dir"):
        load_settings(p)


def test_load_settings_missing_file(tmp_path):
    with pytest.raises(OSError):
        load_settings(tmp_path / "nope.yaml")


@pytest.mark.parametrize("field,value", [
    ("file_audit", {"max_entries": 0}), ("file_audit", {"hash_budget_mb": -1}), ("file_audit", {"walk": 1}),
    ("pools", {"max_pools": 0}), ("quotas", {"pools": -1}), ("quotas", {"leases": -1}),
])
def test_caps_below_their_minimum_or_unknown_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        DaemonSettings(**{field: value})


@pytest.mark.parametrize("interval", [0, -1])
def test_a_checkpoint_interval_that_is_not_positive_is_refused(tmp_path, interval):
    with pytest.raises(ValueError, match="checkpoint_interval_s"):
        make(tmp_path, checkpoint_interval_s=interval)


def test_rpc_limits_have_bounded_defaults():
    rpc = DaemonSettings().rpc_limits
    assert rpc.streams_per_principal >= 1 and rpc.unary_calls_per_principal >= 1
    assert 0 < rpc.stream_send_timeout_s <= 60 and 0 < rpc.unauthenticated_idle_timeout_s <= 30
    assert rpc.unauthenticated_connections < rpc.connections_per_principal < rpc.max_connections
    assert rpc.max_pending_rpcs > 1000, "gRPC's own 1,000 cancels a burst unrecorded"


@pytest.mark.parametrize("field, value", [
    ("streams_per_principal", 0), ("unary_calls_per_principal", 0), ("unauthenticated_rpcs", 0),
    ("stream_send_timeout_s", 0), ("stream_idle_timeout_s", -1), ("connections_per_principal", 0),
    ("unauthenticated_connections", 0), ("max_connections", 0), ("unauthenticated_idle_timeout_s", 0),
    ("max_pending_rpcs", 10), ("no_such_limit", 1),
])
def test_rpc_limits_refuse_what_would_disable_them(field, value):
    with pytest.raises(ValueError, match=field):
        DaemonSettings(rpc_limits={field: value})
