"""sandboxd.core.settings: workspace roots that could expose the daemon are refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from sandboxd.core.settings import DOCKER_SOCKET, DaemonSettings, LimitSettings, load_settings
from sandboxd.core.safe_open import UnsafeFile

from .fifos import finishes, make_fifo


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
    with pytest.raises(UnsafeFile, match="does not exist"):
        load_settings(tmp_path / "nope.yaml")


def test_load_settings_refuses_a_fifo_without_waiting_on_it(tmp_path):
    fifo = make_fifo(tmp_path / "sandboxd.yaml")
    with pytest.raises(UnsafeFile, match="regular file"):
        finishes(fifo, lambda: load_settings(fifo))


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


# ------------------------------------------------------------------ modes (octal in YAML)


def load_yaml(tmp_path, text: str) -> DaemonSettings:
    path = tmp_path / "sandboxd.yaml"
    path.write_text(text)
    return load_settings(path)


@pytest.mark.parametrize("spelled", ["0o666", "0666", '"0o666"', '"0666"', "'0O666'"])
def test_a_mode_is_read_in_octal_however_yaml_spells_it(tmp_path, spelled):
    assert load_yaml(tmp_path, f"socket_mode: {spelled}\n").socket_mode == 0o666


def test_a_mode_given_in_python_is_taken_as_given(tmp_path):
    assert make(tmp_path, socket_mode=0o640).socket_mode == 0o640
    assert make(tmp_path, socket_mode=420).socket_mode == 0o644


@pytest.mark.parametrize("spelled, reason", [
    ("666", "666 is written in decimal (= 0o1232)"),  # never silently 0o666
    ("438", "written in decimal (= 0o666)"),
    ("0o999", "not an octal mode"),
    ('"0999"', "not an octal mode"),
    ("rw", "not an octal mode"),
    ('"666"', "not an octal mode"),
    ("-1", "outside 0o0..0o777"),
    ("0o1777", "outside 0o0..0o777"),
    ("0o17777", "outside 0o0..0o777"),
    ("true", "not a mode"),
    ("[1]", "not a mode"),
])
def test_a_mode_that_is_no_octal_permission_is_refused_with_its_field(tmp_path, spelled, reason):
    with pytest.raises(ValueError) as exc:
        load_yaml(tmp_path, f"socket_mode: {spelled}\n")
    assert "socket_mode" in str(exc.value) and reason in str(exc.value)


def test_decimal_ints_elsewhere_are_plain_ints(tmp_path):
    s = load_yaml(tmp_path, "max_concurrent_calls: 40\nprincipals: {0: root, 1000: alice}\n")
    assert s.max_concurrent_calls == 40 and type(s.max_concurrent_calls) is int
    assert s.principals == {0: "root", 1000: "alice"}


def test_every_mode_setting_reads_octal():
    """A *_mode setting added later must take the same octal forms (FileMode)."""
    from sandboxd.core.config_file import _file_mode

    def modes(model: type) -> list[str]:
        found = []
        for name, field in model.model_fields.items():
            if name.endswith("_mode"):
                found.append(name)
                assert any(getattr(m, "func", None) is _file_mode for m in field.metadata), name
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                found += modes(ann)
        return found

    assert modes(DaemonSettings) == ["socket_mode"]


# ------------------------------------------------------------------ the README's examples

README = Path(__file__).resolve().parents[2] / "README.md"
# A YAML block is a daemon config when one of its top-level keys is a setting, a policy
# when all are policy sections; every block must be one of the two.
POLICY_SECTIONS = {"filesystem", "network", "environment", "process", "audit", "credentialRefs"}


def readme_yaml_blocks() -> list[str]:
    return re.findall(r"^```yaml\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_every_daemon_config_block_of_the_readme_loads(tmp_path):
    """As the daemon loads --config. Files the examples name under /etc/sandboxd exist
    here in a temporary directory (the TCP listener's certificates must be files)."""
    etc = tmp_path / "etc"
    configs = 0
    # A fence's info string may name the block's kind (```yaml sandboxd-config); every
    # kind of every doc is checked by test_doc_examples.py.
    for block in re.findall(r"^```yaml[^\n]*\n(.*?)^```", README.read_text(), flags=re.S | re.M):
        keys = set(yaml.safe_load(block))
        if keys & set(DaemonSettings.model_fields):
            text = block.replace("/etc/sandboxd/", f"{etc}/")
            for name in re.findall(rf"{re.escape(str(etc))}/[\w./-]+", text):
                Path(name).parent.mkdir(parents=True, exist_ok=True)
                Path(name).touch()
            path = tmp_path / f"readme-{configs}.yaml"
            path.write_text(text)
            load_settings(path)  # raises with the field path and the reason
            configs += 1
        else:
            assert keys <= POLICY_SECTIONS, f"a README YAML block that is neither config nor policy: {keys}"
    assert configs >= 4
