"""sandboxd.policy.preflight on a real filesystem under tmp_path (tests run as root; the
workspace is chowned to a non-root uid like a user's checkout)."""

from __future__ import annotations

import os

import pytest

from sandboxd.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied, SandboxdError
from sandboxd.policy.always_blocked import always_blocked
from sandboxd.policy.preflight import (Bind, Mask, _hard_linked, always_blocked_rule, preflight, resolve_workspace,
                                       sandbox_owner)
from sandboxd.core.settings import DaemonSettings

from .conftest import WORKSPACE_GID, WORKSPACE_UID, resolve


def _shapes(masks) -> tuple:
    return tuple((m.sandbox_path, m.kind) for m in masks)


def _bind(sandbox_path: str, host, read_only: bool) -> Bind:
    """A bind as preflight makes it: with the inode it checked, which staging compares."""
    st = os.lstat(host)
    return Bind(sandbox_path, str(host), read_only, st.st_dev, st.st_ino)


def refused(cls, fn, *args, **kwargs) -> SandboxdError:
    with pytest.raises(SandboxdError) as info:
        fn(*args, **kwargs)
    assert type(info.value) is cls, f"expected {cls.__name__}, got {type(info.value).__name__}: {info.value}"
    return info.value


def plan_for(host, fs: dict | None = None, workspace: str | None = None, settings: DaemonSettings | None = None):
    policy = resolve(None if fs is None else {"filesystem": fs})
    return preflight(policy, workspace or str(host.ws), settings or host.settings)


def mkfile(path, text="x"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ------------------------------------------------------------------ workspace


def test_plain_workspace(host):
    plan = plan_for(host)
    assert plan.workspace == str(host.ws)
    assert (plan.uid, plan.gid) == (WORKSPACE_UID, WORKSPACE_GID)
    assert plan.binds == (_bind("/workspace", host.ws, read_only=True),)
    assert _shapes(plan.masks) == () and plan.notes == ()


def test_workspace_outside_roots(host):
    os.chown(host.outside, WORKSPACE_UID, WORKSPACE_GID)
    exc = refused(PermissionDenied, plan_for, host, workspace=str(host.outside))
    assert exc.field == "workspace"
    assert exc.status == "PERMISSION_DENIED"


def test_workspace_escaping_via_dotdot(host):
    exc = refused(PermissionDenied, plan_for, host, workspace=f"{host.ws}/../../outside")
    assert exc.field == "workspace"


def test_workspace_via_symlink_out(host):
    link = host.roots / "sneaky"
    link.symlink_to(host.outside)
    exc = refused(PermissionDenied, plan_for, host, workspace=str(link))
    assert exc.field == "workspace"


def test_workspace_via_symlink_inside_roots_resolves(host):
    link = host.roots / "alias"
    link.symlink_to(host.ws)
    assert plan_for(host, workspace=str(link)).workspace == str(host.ws)


@pytest.mark.parametrize("suffix", ["", "/", "/.", "/alice/.."])
def test_workspace_equal_to_root_is_refused(host, suffix):
    exc = refused(PermissionDenied, plan_for, host, workspace=str(host.roots) + suffix)
    assert exc.field == "workspace"


def test_workspace_must_be_absolute(host):
    exc = refused(InvalidArgument, plan_for, host, workspace="roots/alice")
    assert exc.field == "workspace"


def test_missing_workspace(host):
    exc = refused(FailedPrecondition, plan_for, host, workspace=str(host.roots / "nobody"))
    assert exc.field == "workspace"


def test_workspace_that_is_a_file(host):
    f = mkfile(host.roots / "file")
    exc = refused(FailedPrecondition, plan_for, host, workspace=str(f))
    assert exc.field == "workspace"


def test_resolve_workspace_returns_real_path(host):
    assert resolve_workspace(f"{host.ws}/./", host.settings) == str(host.ws)


def test_root_owned_workspace_is_refused(host):
    os.chown(host.ws, 0, 0)
    exc = refused(PermissionDenied, plan_for, host)
    assert exc.field == "workspace"
    assert "root_workspace_uid" in exc.reason


def test_root_owned_workspace_with_configured_uid(host):
    os.chown(host.ws, 0, 0)
    settings = host.settings.model_copy(update={"root_workspace_uid": 4321})
    assert sandbox_owner(str(host.ws), settings) == (4321, 4321)
    settings = host.settings.model_copy(update={"root_workspace_uid": 4321, "root_workspace_gid": 99})
    plan = plan_for(host, settings=settings)
    assert (plan.uid, plan.gid) == (4321, 99)


def test_owner_of_workspace_is_the_sandbox_user(host):
    os.chown(host.ws, 2345, 3456)
    plan = plan_for(host)
    assert (plan.uid, plan.gid) == (2345, 3456)


# ------------------------------------------------------------------ roots


def test_read_and_write_roots_become_binds(host):
    (host.ws / "src").mkdir()
    (host.ws / "out").mkdir()
    plan = plan_for(host, {"readRoots": ["src"], "writeRoots": ["/workspace/out"]})
    assert plan.binds == (_bind("/workspace/src", host.ws / "src", True),
                          _bind("/workspace/out", host.ws / "out", False))


def test_a_root_both_read_and_written_is_one_writable_bind(host):
    # Writable, so the call counts as a writer (calls/reservations.py), and blocked paths stay masked.
    mkfile(host.ws / ".env")
    plan = plan_for(host, {"readRoots": ["/workspace"], "writeRoots": ["/workspace"], "blockedPaths": [".env"]})
    assert plan.binds == (_bind("/workspace", host.ws, read_only=False),)
    assert _shapes(plan.masks) == (("/workspace/.env", "file"),)


def test_a_write_root_inside_a_read_root_is_bound_writable_after_its_parent(host):
    mkfile(host.ws / "out" / "token")
    mkfile(host.ws / ".env")
    plan = plan_for(host, {"writeRoots": ["out"], "readRoots": ["/workspace", "src"],
                           "blockedPaths": ["out/token", ".env"]})
    assert plan.binds == (_bind("/workspace", host.ws, read_only=True), _bind("/workspace/out", host.ws / "out", False))
    assert set(_shapes(plan.masks)) == {("/workspace/out/token", "file"), ("/workspace/.env", "file")}


def test_a_dropped_root_is_not_looked_at_but_its_parent_is(host):
    # out/sub is covered by out, a root of its own kind (and never checked); out itself is
    # still refused as a symlink.
    (host.ws / "real").mkdir()
    (host.ws / "out").symlink_to(host.ws / "real")
    exc = refused(PermissionDenied, plan_for, host, {"readRoots": ["out/sub", "out"]})
    assert exc.field == "policy.filesystem.readRoots[1]"  # the caller's index, not the reduced list's
    exc = refused(PermissionDenied, plan_for, host, {"writeRoots": ["out/sub", "out"]})
    assert exc.field == "policy.filesystem.writeRoots[1]"


def test_a_refusal_names_the_callers_own_entry_after_roots_merge(host):
    (host.ws / "a").mkdir()
    (host.ws / "src").mkdir(exist_ok=True)
    (host.ws / "real").mkdir()
    (host.ws / "link").symlink_to(host.ws / "real")
    # "a" becomes a write root and "src" repeats: "link" is readRoots[3] as the caller wrote it.
    exc = refused(PermissionDenied, plan_for, host, {"readRoots": ["a", "src", "src/", "link"], "writeRoots": ["a"]})
    assert exc.field == "policy.filesystem.readRoots[3]"
    exc = refused(PermissionDenied, plan_for, host, {"readRoots": ["link"], "writeRoots": ["a", "a", "link"]})
    assert exc.field == "policy.filesystem.writeRoots[2]"


def test_write_roots_in_temp_dir_produce_no_bind(host):
    (host.ws / "out").mkdir()
    plan = plan_for(host, {"readRoots": [], "writeRoots": ["/tmp", "/tmp/build", "/workspace/out"]})
    assert [b.sandbox_path for b in plan.binds] == ["/workspace/out"]


def test_write_roots_in_custom_temp_dir_produce_no_bind(host):
    plan = plan_for(host, {"readRoots": ["/workspace"], "writeRoots": ["/scratch/x"], "tempDir": "/scratch"})
    assert [b.sandbox_path for b in plan.binds] == ["/workspace"]


def test_empty_roots_give_no_binds(host):
    plan = plan_for(host, {})
    assert plan.binds == () and _shapes(plan.masks) == ()


def test_missing_read_root(host):
    (host.ws / "a").mkdir()
    exc = refused(FailedPrecondition, plan_for, host, {"readRoots": ["a", "missing"]})
    assert exc.field == "policy.filesystem.readRoots[1]"
    assert exc.status == "FAILED_PRECONDITION"


def test_missing_write_root(host):
    exc = refused(FailedPrecondition, plan_for, host, {"readRoots": ["/workspace"], "writeRoots": ["/tmp/x", "nope"]})
    assert exc.field == "policy.filesystem.writeRoots[1]"


def test_read_root_symlink_inside_is_refused(host):
    (host.ws / "real").mkdir()
    (host.ws / "link").symlink_to(host.ws / "real")
    exc = refused(PermissionDenied, plan_for, host, {"readRoots": ["link"]})
    assert exc.field == "policy.filesystem.readRoots[0]"
    assert "symlink" in exc.reason


def test_relative_symlink_root_is_refused(host):
    (host.ws / "real").mkdir()
    (host.ws / "link").symlink_to("real")
    exc = refused(PermissionDenied, plan_for, host, {"readRoots": ["/workspace/link"]})
    assert exc.field == "policy.filesystem.readRoots[0]"


def test_read_root_symlink_out_is_refused(host):
    (host.ws / "out").symlink_to(host.outside)
    exc = refused(PermissionDenied, plan_for, host, {"readRoots": ["out"]})
    assert exc.field == "policy.filesystem.readRoots[0]"
    assert "outside" in exc.reason


def test_write_root_symlink_out_is_refused(host):
    (host.ws / "a").mkdir()
    (host.ws / "etc").symlink_to("/etc")
    exc = refused(PermissionDenied, plan_for, host, {"readRoots": ["a"], "writeRoots": ["/workspace/etc"]})
    assert exc.field == "policy.filesystem.writeRoots[0]"


def test_root_below_a_symlinked_directory_is_refused(host):
    (host.ws / "real" / "sub").mkdir(parents=True)
    (host.ws / "link").symlink_to(host.ws / "real")
    exc = refused(PermissionDenied, plan_for, host, {"readRoots": ["/workspace/link/sub"]})
    assert exc.field == "policy.filesystem.readRoots[0]"


def test_dangling_symlink_root_is_refused(host):
    (host.ws / "dangling").symlink_to(host.ws / "nothing")
    with pytest.raises((PermissionDenied, FailedPrecondition)) as info:
        plan_for(host, {"readRoots": ["dangling"]})
    assert info.value.field == "policy.filesystem.readRoots[0]"


def test_file_root_is_a_bind_of_the_file(host):
    f = mkfile(host.ws / "config.yml")
    plan = plan_for(host, {"readRoots": ["config.yml"]})
    assert plan.binds == (_bind("/workspace/config.yml", f, True),)


# ------------------------------------------------------------------ blocked paths


def test_blocked_file_is_masked_as_file(host):
    mkfile(host.ws / ".env", "SECRET=1")
    plan = plan_for(host, {"readRoots": ["/workspace"], "blockedPaths": [".env"]})
    assert _shapes(plan.masks) == (("/workspace/.env", "file"),)
    assert plan.notes == ()
    st = os.lstat(host.ws / ".env")  # the inode staging masks, and only it
    assert (plan.masks[0].dev, plan.masks[0].ino) == (st.st_dev, st.st_ino)


def test_blocked_dir_is_masked_as_dir(host):
    mkfile(host.ws / ".git" / "config")
    plan = plan_for(host, {"readRoots": ["/workspace"], "blockedPaths": ["/workspace/.git"]})
    assert _shapes(plan.masks) == (("/workspace/.git", "dir"),)


def test_missing_blocked_path_is_a_note(host):
    plan = plan_for(host, {"readRoots": ["/workspace"], "blockedPaths": ["/workspace/nothing"]})
    assert _shapes(plan.masks) == ()
    assert len(plan.notes) == 1 and "/workspace/nothing" in plan.notes[0]


def test_blocked_path_not_under_any_root_is_a_note(host):
    (host.ws / "src").mkdir()
    mkfile(host.ws / "secret" / "key")
    plan = plan_for(host, {"readRoots": ["src"], "blockedPaths": ["secret"]})
    assert _shapes(plan.masks) == ()
    assert len(plan.notes) == 1 and "/workspace/secret" in plan.notes[0]


def test_blocked_path_only_in_temp_dir_write_root_is_a_note(host):
    mkfile(host.ws / "secret")
    plan = plan_for(host, {"writeRoots": ["/tmp/x"], "blockedPaths": ["secret"]})
    assert _shapes(plan.masks) == () and len(plan.notes) == 1


def test_blocked_dangling_symlink_is_a_note(host):
    # .env -> secrets/.env.local, which does not exist (yet). Nothing can be masked;
    # preflight must say so rather than fail with an unhandled FileNotFoundError
    # (which the service turns into INTERNAL).
    (host.ws / ".env").symlink_to("secrets/.env.local")
    plan = plan_for(host, {"readRoots": ["/workspace"], "blockedPaths": [".env"]})
    assert _shapes(plan.masks) == ()
    assert len(plan.notes) == 1 and ".env" in plan.notes[0]


def test_blocked_symlink_out_of_workspace_is_a_note(host):
    (host.ws / "leak").symlink_to(host.outside / "secret.txt")
    plan = plan_for(host, {"readRoots": ["/workspace"], "blockedPaths": ["leak"]})
    assert _shapes(plan.masks) == ()
    assert len(plan.notes) == 1 and "outside" in plan.notes[0]


def test_blocked_file_with_hard_link_elsewhere(host):
    secret = mkfile(host.ws / "secret.key")
    os.link(secret, host.ws / "innocent.txt")
    exc = refused(FailedPrecondition, plan_for, host, {"readRoots": ["/workspace"], "blockedPaths": ["/workspace/x", "secret.key"]})
    assert exc.field == "policy.filesystem.blockedPaths[1]"


def test_blocked_dir_containing_hard_linked_file(host):
    secret = mkfile(host.ws / "secrets" / "deep" / "key")
    os.link(secret, host.ws / "copy")
    exc = refused(FailedPrecondition, plan_for, host, {"readRoots": ["/workspace"], "blockedPaths": ["secrets"]})
    assert exc.field == "policy.filesystem.blockedPaths[0]"
    assert "key" in exc.reason


def test_hard_link_check_skipped_when_invisible(host):
    (host.ws / "src").mkdir()
    secret = mkfile(host.ws / "secret.key")
    os.link(secret, host.ws / "copy")
    plan = plan_for(host, {"readRoots": ["src"], "blockedPaths": ["secret.key"]})
    assert _shapes(plan.masks) == () and len(plan.notes) == 1


def test_symlink_to_blocked_file_masks_the_target(host):
    mkfile(host.ws / "real" / "secret.txt")
    (host.ws / "alias.txt").symlink_to("real/secret.txt")
    plan = plan_for(host, {"readRoots": ["/workspace"], "blockedPaths": ["alias.txt"]})
    assert _shapes(plan.masks) == (("/workspace/real/secret.txt", "file"),)


def test_blocked_absolute_sandbox_symlink_is_not_dismissed(host):
    # Inside the sandbox an absolute link resolves against the sandbox's root, so
    # /workspace/creds -> /workspace/.secrets/creds reaches the workspace's secret.
    # Resolved on the host, the same link points at a host path "/workspace/..." and
    # preflight dismisses it as "outside the workspace, which is not mounted": nothing
    # is masked and the blocked alias stays readable. It must mask the in-sandbox
    # target, or refuse.
    mkfile(host.ws / ".secrets" / "creds", "token")
    (host.ws / "creds").symlink_to("/workspace/.secrets/creds")
    try:
        plan = plan_for(host, {"readRoots": ["/workspace"], "blockedPaths": ["/workspace/creds"]})
    except SandboxdError:
        return
    assert ("/workspace/.secrets/creds", "file") in _shapes(plan.masks), plan


def test_blocked_path_through_symlinked_dir_masks_the_target(host):
    mkfile(host.ws / "real" / "secret.txt")
    (host.ws / "linkdir").symlink_to(host.ws / "real")
    plan = plan_for(host, {"readRoots": ["/workspace"], "blockedPaths": ["linkdir/secret.txt"]})
    assert _shapes(plan.masks) == (("/workspace/real/secret.txt", "file"),)


def test_aliases_of_one_blocked_path_give_one_mask(host):
    mkfile(host.ws / "real" / "secret.txt")
    (host.ws / "alias.txt").symlink_to(host.ws / "real" / "secret.txt")
    plan = plan_for(host, {"readRoots": ["/workspace"], "blockedPaths": ["real/secret.txt", "alias.txt"]})
    assert _shapes(plan.masks) == (("/workspace/real/secret.txt", "file"),)


def test_masks_under_a_write_root(host):
    mkfile(host.ws / "out" / "token")
    plan = plan_for(host, {"readRoots": [], "writeRoots": ["out"], "blockedPaths": ["out/token"]})
    assert _shapes(plan.masks) == (("/workspace/out/token", "file"),)


def test_blocked_symlink_aliasing_a_read_root_is_not_exposed(host):
    # blockedPaths says "never visible, by any alias". /workspace/alias is the same
    # directory as /workspace/data, and /workspace/data/public lies inside it: the
    # lexical check in resolve_policy ("a root inside a blocked path") cannot see the
    # alias, so preflight must refuse it. Today preflight calls the blocked target
    # "not under any read or write root" and mounts it anyway.
    mkfile(host.ws / "data" / "public" / "secret.csv")
    (host.ws / "alias").symlink_to("data")
    with pytest.raises((InvalidArgument, PermissionDenied, FailedPrecondition)):
        plan_for(host, {"readRoots": ["/workspace/data/public"], "blockedPaths": ["/workspace/alias"]})


def test_blocked_symlink_equal_to_a_read_root_is_refused(host):
    # The same through an alias of the root itself: the plan would bind
    # /workspace/data and mount a mask on the same target, which Docker refuses as a
    # duplicate mount point; the policy is self-contradictory and must be refused here.
    mkfile(host.ws / "data" / "secret.csv")
    (host.ws / "alias").symlink_to("data")
    with pytest.raises((InvalidArgument, PermissionDenied, FailedPrecondition)):
        plan_for(host, {"readRoots": ["/workspace/data"], "blockedPaths": ["/workspace/alias"]})


def test_blocked_symlink_to_the_whole_workspace_is_refused(host):
    # Lexically, blocking /workspace is refused ("use empty roots instead"); through an
    # alias (/workspace/here -> .) preflight calls it "not under any root" and leaves
    # /workspace/src visible.
    (host.ws / "src").mkdir()
    (host.ws / "here").symlink_to(".")
    with pytest.raises((InvalidArgument, PermissionDenied, FailedPrecondition)):
        plan_for(host, {"readRoots": ["/workspace/src"], "blockedPaths": ["/workspace/here"]})


def test_too_many_files_in_blocked_dir_is_refused_naming_the_field(host, monkeypatch):
    import sandboxd.policy.preflight as preflight_module
    monkeypatch.setattr(preflight_module, "MAX_BLOCKED_SCAN_ENTRIES", 3)
    for i in range(4):
        mkfile(host.ws / "big" / f"f{i}")
    exc = refused(FailedPrecondition, plan_for, host, {"readRoots": ["/workspace"], "blockedPaths": ["big"]})
    assert exc.field == "policy.filesystem.blockedPaths[0]"


def test_blocked_dir_at_scan_limit_is_masked(host, monkeypatch):
    import sandboxd.policy.preflight as preflight_module
    monkeypatch.setattr(preflight_module, "MAX_BLOCKED_SCAN_ENTRIES", 3)
    for i in range(3):
        mkfile(host.ws / "big" / f"f{i}")
    assert _shapes(plan_for(host, {"readRoots": ["/workspace"], "blockedPaths": ["big"]}).masks) == (("/workspace/big", "dir"),)


def test_blocked_path_inside_a_blocked_dir_adds_no_nested_mask(host):
    # A mask inside a masked directory would need a mount point inside the read-only,
    # empty tmpfs that masks the parent; runc cannot create it (EROFS) and the
    # sandbox fails to start. The nested path is already invisible.
    mkfile(host.ws / "secrets" / "key")
    plan = plan_for(host, {"readRoots": ["/workspace"], "blockedPaths": ["secrets", "secrets/key"]})
    assert _shapes(plan.masks) == (("/workspace/secrets", "dir"),)


def test_preflight_does_not_modify_the_workspace(host):
    mkfile(host.ws / "a" / "b")
    before = sorted(os.walk(host.ws))
    plan_for(host, {"readRoots": ["/workspace"], "blockedPaths": ["a", "missing"]})
    assert sorted(os.walk(host.ws)) == before


@pytest.mark.parametrize("place", ["runtime_dir", "secrets_dir"])
def test_the_daemons_own_directories_are_never_a_workspace(host, place):
    # They hold what the daemon hands other sandboxes (output FIFOs, gates, secrets).
    inside = host.roots / "daemon-place"
    inside.mkdir()
    os.chown(inside, WORKSPACE_UID, WORKSPACE_GID)
    assert resolve_workspace(str(inside), host.settings) == str(inside)  # the places resolved once: by value
    settings = host.settings.model_copy(update={place: inside})
    refused(PermissionDenied, resolve_workspace, str(inside), settings)
    below = inside / "ws"
    below.mkdir()
    os.chown(below, WORKSPACE_UID, WORKSPACE_GID)
    refused(PermissionDenied, resolve_workspace, str(below), settings)


def test_the_hard_link_walk_never_goes_through_a_symlink(host, tmp_path):
    """The walk runs as root: a blocked directory swapped for a link to a place its owner
    cannot read must not be walked (its file names would come back in the refusal)."""
    outside = tmp_path / "root-only"
    outside.mkdir(mode=0o700)
    (outside / "payroll.csv").write_text("x")
    os.link(outside / "payroll.csv", outside / "payroll-copy.csv")
    os.symlink(outside, host.ws / "blocked")
    with pytest.raises(FailedPrecondition) as exc:
        _hard_linked(str(host.ws), str(host.ws / "blocked"), "policy.filesystem.blockedPaths[0]")
    assert "payroll" not in exc.value.message and exc.value.field == "policy.filesystem.blockedPaths[0]"
    (host.ws / "real").mkdir()
    (host.ws / "real" / "a").write_text("a")
    os.link(host.ws / "real" / "a", host.ws / "b")
    assert _hard_linked(str(host.ws), str(host.ws / "real"), "f") == str(host.ws / "real" / "a")


def test_a_blocked_path_that_cannot_be_looked_at_is_refused_not_left_unmasked(host, monkeypatch):
    """os.path.lexists says False on EACCES too (root on a FUSE or root-squashed NFS
    workspace): that was a blocked path silently left visible."""
    import errno as errno_module

    import sandboxd.policy.preflight as preflight_module

    mkfile(host.ws / "secret.txt", "s")
    real_lstat = os.lstat

    def lstat(path, *args, **kwargs):
        if str(path).endswith("secret.txt"):
            raise PermissionError(errno_module.EACCES, "Permission denied")
        return real_lstat(path, *args, **kwargs)

    monkeypatch.setattr(preflight_module.os, "lstat", lstat)
    with pytest.raises(FailedPrecondition) as exc:
        plan_for(host, {"readRoots": ["/workspace"], "blockedPaths": ["secret.txt"]})
    assert exc.value.field == "policy.filesystem.blockedPaths[0]"


def test_a_root_swapped_while_it_is_resolved_is_a_refusal_not_an_internal_error(host, monkeypatch):
    """realpath's readlink fails (EINVAL) when the link it found was swapped for a
    directory meanwhile (a swap loop made calls end INTERNAL)."""
    import errno as errno_module

    import sandboxd.policy.preflight as preflight_module

    (host.ws / "data").mkdir()
    real_realpath = os.path.realpath

    def racing(path, *args, **kwargs):
        if str(path).endswith("/data"):
            raise OSError(errno_module.EINVAL, "Invalid argument", str(path))
        return real_realpath(path, *args, **kwargs)

    monkeypatch.setattr(preflight_module.os.path, "realpath", racing)
    for policy, field in (({"readRoots": ["/workspace/data"]}, "policy.filesystem.readRoots[0]"),
                          ({"readRoots": ["/workspace"], "blockedPaths": ["data"]}, "policy.filesystem.blockedPaths[0]")):
        with pytest.raises(FailedPrecondition) as exc:
            plan_for(host, policy)
        assert exc.value.field == field and "changed while it was checked" in exc.value.message


# ------------------------------------------------------------------ the operator's always_blocked


def with_blocked(host, *patterns: str) -> DaemonSettings:
    return host.settings.model_copy(update={"always_blocked": patterns})


def test_the_default_list_masks_dotenv_but_not_its_templates_without_any_policy(host):
    mkfile(host.ws / ".env", "SECRET=hunter2")
    mkfile(host.ws / ".env.local", "SECRET=2")
    mkfile(host.ws / ".env.example", "SECRET=")
    mkfile(host.ws / ".env.sample")
    mkfile(host.ws / ".env.template")
    mkfile(host.ws / "README.md")
    plan = plan_for(host)  # no policy: all of /workspace readable
    assert set(_shapes(plan.masks)) == {("/workspace/.env", "file"), ("/workspace/.env.local", "file")}
    assert {m.rule for m in plan.masks} == {"always_blocked: .env", "always_blocked: .env.*"}
    assert "always_blocked: .env masks /workspace/.env: the daemon's list, no policy unblocks it" in plan.notes
    st = os.lstat(host.ws / ".env")
    [env] = [m for m in plan.masks if m.sandbox_path == "/workspace/.env"]
    assert (env.dev, env.ino) == (st.st_dev, st.st_ino)


def test_the_default_list_is_the_top_level_only_and_names_credential_directories(host):
    mkfile(host.ws / "sub" / ".env", "deeper")
    mkfile(host.ws / ".ssh" / "id_ed25519")
    mkfile(host.ws / ".aws" / "credentials")
    mkfile(host.ws / ".docker" / "config.json")
    mkfile(host.ws / ".docker" / "Dockerfile")  # a project's own .docker/ stays readable
    mkfile(host.ws / ".git-credentials")
    assert set(_shapes(plan_for(host).masks)) == {
        ("/workspace/.ssh", "dir"), ("/workspace/.aws", "dir"), ("/workspace/.docker/config.json", "file"),
        ("/workspace/.git-credentials", "file")}


def test_a_pattern_written_any_depth_walks_the_shown_roots(host):
    mkfile(host.ws / ".env")
    mkfile(host.ws / "services" / "api" / ".env")
    mkfile(host.ws / "services" / "api" / ".env.example")
    mkfile(host.ws / "elsewhere" / ".env")
    settings = with_blocked(host, "**/.env*", "!**/.env.example")
    plan = plan_for(host, settings=settings)
    assert set(_shapes(plan.masks)) == {("/workspace/.env", "file"), ("/workspace/services/api/.env", "file"),
                                        ("/workspace/elsewhere/.env", "file")}
    # Only what the call shows is walked, and masked.
    plan = plan_for(host, {"readRoots": ["/workspace/services"]}, settings=settings)
    assert _shapes(plan.masks) == (("/workspace/services/api/.env", "file"),)


def test_the_walk_never_follows_a_symlinked_directory(host, tmp_path):
    outside = tmp_path / "elsewhere"
    mkfile(outside / ".env", "not the workspace's")
    (host.ws / "linked").symlink_to(outside)
    mkfile(host.ws / "real" / ".env")
    plan = plan_for(host, settings=with_blocked(host, "**/.env"))
    assert _shapes(plan.masks) == (("/workspace/real/.env", "file"),)


def test_a_walk_past_its_bound_is_refused_not_half_checked(host, monkeypatch):
    import sandboxd.policy.always_blocked_host as host_matching

    for i in range(6):
        mkfile(host.ws / "d" / f"f{i}")
    monkeypatch.setattr(host_matching, "MAX_ALWAYS_BLOCKED_ENTRIES", 5)
    exc = refused(FailedPrecondition, plan_for, host, {"readRoots": ["/workspace/d"]},
                  settings=with_blocked(host, "**/.env"))
    assert exc.field == "policy.filesystem.readRoots[0]" and "always_blocked" in exc.reason
    monkeypatch.setattr(host_matching, "MAX_ALWAYS_BLOCKED_ENTRIES", 6)
    assert plan_for(host, {"readRoots": ["/workspace/d"]}, settings=with_blocked(host, "**/.env")).masks == ()


def test_a_walk_past_its_depth_is_refused(host, monkeypatch):
    import sandboxd.policy.always_blocked_host as host_matching

    monkeypatch.setattr(host_matching, "MAX_ALWAYS_BLOCKED_DEPTH", 3)
    mkfile(host.ws / "a" / "b" / "c" / "d" / "e")
    exc = refused(FailedPrecondition, plan_for, host, settings=with_blocked(host, "**/.env"))
    assert "deep" in exc.reason


def test_a_policy_cannot_show_an_always_blocked_path(host):
    mkfile(host.ws / ".ssh" / "id_ed25519")
    mkfile(host.ws / ".env")
    for fs, field in (({"readRoots": ["/workspace/.ssh"]}, "policy.filesystem.readRoots[0]"),
                      ({"readRoots": ["/workspace/src", "/workspace/.env"]}, "policy.filesystem.readRoots[1]"),
                      ({"writeRoots": ["/workspace/.ssh"]}, "policy.filesystem.writeRoots[0]")):
        (host.ws / "src").mkdir(exist_ok=True)
        exc = refused(PermissionDenied, plan_for, host, fs)
        assert exc.field == field and "always_blocked" in exc.reason and "no policy can show it" in exc.reason


def test_a_workspace_in_an_always_blocked_directory_is_refused(host):
    home = host.roots / "alice"  # the workspace root's user directory: ~
    for path in (home / ".ssh", home / ".ssh" / "keys"):
        path.mkdir(parents=True)
        os.chown(path, WORKSPACE_UID, WORKSPACE_GID)
        exc = refused(PermissionDenied, plan_for, host, workspace=str(path))
        assert exc.field == "workspace" and "always_blocked: .ssh/" in exc.reason and str(home / ".ssh") in exc.reason


def test_a_pattern_below_a_directory_above_the_workspace_still_masks(host):
    docker = host.ws / ".docker"
    mkfile(docker / "config.json", '{"auths": {}}')
    mkfile(docker / "Dockerfile")
    os.chown(docker, WORKSPACE_UID, WORKSPACE_GID)
    plan = plan_for(host, workspace=str(docker))  # -w ~/.docker
    assert _shapes(plan.masks) == (("/workspace/config.json", "file"),)
    assert plan.masks[0].rule == "always_blocked: .docker/config.json"


def test_an_empty_list_blocks_nothing(host):
    mkfile(host.ws / ".env")
    plan = plan_for(host, settings=with_blocked(host))
    assert plan.masks == () and plan.notes == ()


def test_an_always_blocked_symlink_masks_what_it_names(host):
    mkfile(host.ws / "conf" / "real.env", "SECRET=1")
    (host.ws / ".env").symlink_to("conf/real.env")
    plan = plan_for(host)
    assert _shapes(plan.masks) == (("/workspace/conf/real.env", "file"),)
    assert "always_blocked: .env masks /workspace/conf/real.env (named /workspace/.env)" in plan.notes[0]
    (host.ws / ".env").unlink()
    (host.ws / ".env").symlink_to("conf/missing.env")  # dangling: nothing to mask, nothing said
    assert plan_for(host).masks == () and plan_for(host).notes == ()


def test_an_always_blocked_file_with_a_hard_link_is_refused_naming_the_rule(host):
    mkfile(host.ws / ".env", "SECRET=1")
    os.link(host.ws / ".env", host.ws / "innocent.txt")
    exc = refused(FailedPrecondition, plan_for, host)
    assert exc.field == "workspace" and exc.reason.startswith("always_blocked: .env: ")


def test_a_policy_block_and_the_operators_give_one_mask_named_by_the_first(host):
    mkfile(host.ws / ".env")
    plan = plan_for(host, {"readRoots": ["/workspace"], "blockedPaths": [".env"]})
    assert [(m.sandbox_path, m.rule) for m in plan.masks] == [("/workspace/.env", "policy.filesystem.blockedPaths[0]")]
    assert plan.notes == ()


def test_the_last_matching_pattern_decides(host):
    mkfile(host.ws / "a.key")
    mkfile(host.ws / "b.key")
    plan = plan_for(host, settings=with_blocked(host, "*.key", "!a.key"))
    assert _shapes(plan.masks) == (("/workspace/b.key", "file"),)
    plan = plan_for(host, settings=with_blocked(host, "!a.key", "*.key"))
    assert set(_shapes(plan.masks)) == {("/workspace/a.key", "file"), ("/workspace/b.key", "file")}


@pytest.mark.parametrize("pattern, problem", [
    ("", "no path"), ("/etc/passwd", "no path"), ("!", "no path"), ("a/../b", "'..'"), ("a//b", "empty"),
    ("a/**/b", "'**' only"), ("*/x", "only its last name"), ("x\x00", "NUL"), ("x" * 256, "255 bytes"),
])
def test_a_malformed_pattern_is_refused_naming_its_index(pattern, problem):
    with pytest.raises(InvalidArgument) as exc:
        always_blocked(("ok", pattern))
    assert exc.value.field == "always_blocked[1]" and problem in exc.value.reason


def test_rule_for_names_the_pattern_hiding_a_path_or_a_directory_above_it():
    rules = always_blocked(DaemonSettings().always_blocked)
    assert rules.rule_for(("alice",), (".env",)) == "always_blocked: .env"
    assert rules.rule_for(("alice",), (".ssh", "id_ed25519")) == "always_blocked: .ssh/"
    assert rules.rule_for(("alice",), (".env.example",)) is None
    assert rules.rule_for(("alice",), ("sub", ".env")) is None
    assert rules.rule_for(("alice", ".docker"), ("config.json",)) == "always_blocked: .docker/config.json"


def test_always_blocked_rule_answers_by_name_for_a_resolved_workspace(host):
    ws = str(host.ws)
    assert always_blocked_rule(host.settings, ws, "/workspace/.env.production") == "always_blocked: .env.*"
    assert always_blocked_rule(host.settings, ws, "/workspace/.ssh/config") == "always_blocked: .ssh/"
    assert always_blocked_rule(host.settings, ws, "/workspace/.env.example") is None
    assert always_blocked_rule(host.settings, ws, "/workspace") is None
    assert always_blocked_rule(host.settings, ws, "/tmp/.env") is None  # tempDir: the sandbox's own
    assert always_blocked_rule(with_blocked(host), ws, "/workspace/.env") is None


@pytest.mark.parametrize("root", ["/workspace/proj/.ssh/keys", "/workspace/proj/.ssh/keys/id_rsa"])
def test_a_root_named_inside_a_directory_a_walk_pattern_blocks_is_refused(host, root):
    """`**/.ssh/` blocks the directory: a root named inside it (a directory, or one bound
    file) would show what it holds, and the walk never meets the name `.ssh` below it."""
    mkfile(host.ws / "proj" / ".ssh" / "keys" / "id_rsa", "PRIVATE")
    exc = refused(PermissionDenied, plan_for, host, {"readRoots": [root]}, settings=with_blocked(host, "**/.ssh/"))
    assert "always_blocked: **/.ssh/" in exc.reason and exc.field == "policy.filesystem.readRoots[0]"
